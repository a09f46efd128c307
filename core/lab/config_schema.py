"""The Hydra structured configs of `servelab`'s own nodes: `engine`, `run` and
`report` are dataclass schemas in the ConfigStore, so Hydra refuses a misspelt
key or a wrong type (`engine.compile=maybe`, `engine.max_num_seqs=abc`,
`run.warmup=2.5`) while composing, before anything is built. `report.slo` is a
typed node of its own, never null, so `report.slo.ttft_ms=200`,
`'report.slo={ttft_ms: 200}'` and `++report.slo=...` all compose.

The schemas are made from the same tables the Python API checks against
(ENGINE_DEFAULTS/ENGINE_TYPES, RUN_DEFAULTS/RUN_TYPES, REPORT_DEFAULTS/
REPORT_TYPES), so `LLM(...)` and the command line cannot drift apart. The
part nodes (`scheduler`, `allocator`, ...) stay open: their options are
typed by each part's constructor (registry/typed.py) once its name is known.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

from servelab.contracts.kinds import KINDS
from servelab.engine.build import ENGINE_DEFAULTS, ENGINE_TYPES
from servelab.lab.report import REPORT_DEFAULTS, REPORT_TYPES
from servelab.lab.runner import RUN_DEFAULTS, RUN_TYPES
from servelab.lab.slo import SLO_DEFAULTS, SLO_TYPES
from servelab.serve.config import SERVE_DEFAULTS, SERVE_TYPES

SCHEMA_NAME = "servelab_schema"
# the open nodes: each is a part, a model, a hardware profile or a workload, typed by its own code
OPEN_NODES = ("model", *KINDS, "hardware", "workload", "cluster")


def omegaconf_type(annotation: Any) -> Any:
    """`annotation` as OmegaConf spells it: `int | None` is Optional[int]; a union
    of two value types (`int | str` sizes) is Any, left to the Python checks."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return Optional[omegaconf_type(members[0])]  # noqa: UP045 (OmegaConf reads Optional, not X | None)
        return Any
    if annotation is list:
        return list[Any]
    if annotation is dict:
        return dict[str, Any]
    return annotation


def schema(
    name: str, defaults: dict[str, Any], annotations: dict[str, Any], nested: dict | None = None
) -> type:
    """A dataclass with one typed field per option, defaulting as `defaults` do;
    a key of `nested` is a node typed by that schema (null allowed)."""
    fields = []
    for key, default in defaults.items():
        kind = omegaconf_type(annotations.get(key, Any))
        if key in (nested or {}):
            kind = Optional[nested[key]]  # noqa: UP045 (as above)
            value = dataclasses.field(default_factory=nested[key])
        elif isinstance(default, list):
            value = dataclasses.field(default_factory=lambda d=default: list(d))
        else:
            value = dataclasses.field(default=default)
        fields.append((key, kind, value))
    return dataclasses.make_dataclass(name, fields)


EngineSchema = schema("EngineSchema", ENGINE_DEFAULTS, ENGINE_TYPES)
RunSchema = schema("RunSchema", RUN_DEFAULTS, RUN_TYPES)
SloSchema = schema("SloSchema", SLO_DEFAULTS, SLO_TYPES)
ReportSchema = schema("ReportSchema", REPORT_DEFAULTS, REPORT_TYPES, {"slo": SloSchema})
ServeSchema = schema("ServeSchema", SERVE_DEFAULTS, SERVE_TYPES)
ServelabSchema = dataclasses.make_dataclass(
    "ServelabSchema",
    [(node, Any, dataclasses.field(default=None)) for node in OPEN_NODES]
    + [
        ("engine", EngineSchema, dataclasses.field(default_factory=EngineSchema)),
        ("run", RunSchema, dataclasses.field(default_factory=RunSchema)),
        ("report", ReportSchema, dataclasses.field(default_factory=ReportSchema)),
        ("serve", ServeSchema, dataclasses.field(default_factory=ServeSchema)),
    ],
)


def register_schemas(store: Any) -> None:
    """Stores the schema under SCHEMA_NAME; conf/config.yaml names it first in
    its defaults list, so every composed config is merged onto it."""
    store.store(name=SCHEMA_NAME, node=ServelabSchema)


def composition_message(err: BaseException) -> str:
    """A Hydra composition failure as one `servelab: error:` message: the key, the
    value and what it accepts, or the missing preset with the valid names."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = err
    while not isinstance(cause, OmegaConfBaseException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        node, _, key = str(cause.full_key).rpartition(".")
        accepted = _fields(node)
        where = f"{node} option {key!r}" if node else f"config node {key!r}"
        return f"unknown {where}; accepted: {', '.join(accepted)}" if accepted else str(cause)
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        expected = _accepted(str(cause.full_key))
        if expected:
            node, _, key = str(cause.full_key).rpartition(".")
            return f"{node} option {key} must be {expected}, got {cause.value!r}"
    # a missing preset or group option: Hydra's text lists the valid names
    text = str(err).split("\nConfig search path:")[0].strip()
    message = " ".join(line.strip() for line in text.splitlines() if line.strip())
    # some failures (a config file's interpolation that does not parse) say nothing at the
    # top: the first cause down the chain that says something does
    while not message and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
        message = " ".join(str(err).split())
    return message or type(err).__name__


def _schema_of(node: str) -> type | None:
    schemas = {"": ServelabSchema, "engine": EngineSchema, "run": RunSchema}
    return schemas.get(node, {"report": ReportSchema, "report.slo": SloSchema}.get(node))


def _fields(node: str) -> list[str]:
    found = _schema_of(node)
    return sorted(f.name for f in dataclasses.fields(found)) if found else []


def _accepted(full_key: str) -> str | None:
    from servelab.registry.typed import type_problem

    node, _, key = full_key.rpartition(".")
    tables = {"engine": ENGINE_TYPES, "run": RUN_TYPES, "report": REPORT_TYPES,
              "report.slo": SLO_TYPES}  # fmt: skip
    annotation = tables.get(node, {}).get(key)
    if annotation is None:
        return None
    if annotation in (list, dict):
        return "a list" if annotation is list else "a mapping"
    return type_problem(object(), annotation)
