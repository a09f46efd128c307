"""`servelab-plugins <kind>` lists every built-in part of every kind with its
description and options (with their defaults, as typed on the command line),
read from the kinds table and the classes, so a new kind is listed as soon as
it is in the table; the proposers, named here, are the newest."""

from __future__ import annotations

import json
import re

import pytest

from servelab.contracts.kinds import KINDS
from servelab.registry.listing import _show, main
from servelab.registry.options import describe_options
from servelab.registry.plugin_manager import registered


def listed(capsys, *argv: str) -> str:
    main(list(argv))
    return capsys.readouterr().out


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_builtin_of_a_kind_is_listed_with_its_description_and_options(kind, capsys):
    out = listed(capsys, kind)
    assert out.startswith(f"{kind}:\n")
    lines = out.splitlines()
    builtins = {n: i for n, i in registered(kind).items() if i.origin == "built-in"}
    assert builtins, f"no built-in {kind}"
    for name, info in builtins.items():
        (at,) = [i for i, ln in enumerate(lines) if ln.split()[:2] == [name, "built-in"]]
        assert info.description and lines[at].rstrip().endswith(info.description)
        options = describe_options(info.cls, kind)
        shown = ", ".join(f"{k}={_show(v)}" for k, v in options.items()) or "(none)"
        assert lines[at + 1].split("options: ", 1)[1] == shown


def test_proposers_none_and_ngram_are_listed(capsys):
    out = listed(capsys, "proposer")
    assert re.search(r"\n  none +built-in +no speculative decoding \(the default\)", out)
    assert re.search(r"\n  ngram +built-in +prompt lookup", out)
    common = ("k=4, adaptive_k=false, disable_above_batch_size=null, disable_below_acceptance=null, "
              "acceptance_window=256")
    assert f"options: min_n=1, max_n=3, match=latest, {common}" in out  # ngram's own, then every proposer's
    assert f"options: {common}" in out
    parts = json.loads(listed(capsys, "proposer", "--json"))["parts"]
    assert list(parts) == ["proposer"]
    by_name = {p["name"]: p for p in parts["proposer"]}
    assert by_name["ngram"]["class"] == "servelab.plugins.proposers.ngram.NgramProposer"
    assert by_name["ngram"]["options"] == {
        "min_n": 1, "max_n": 3, "match": "latest", "k": 4, "adaptive_k": False, "disable_above_batch_size": None,
        "disable_below_acceptance": None, "acceptance_window": 256,
    }  # fmt: skip
    assert "vocab_size" not in by_name["none"]["options"]  # engine context, not an option
