"""The token-exact oracle, as the test suite uses it: a thin re-export of
`servelab.testing.oracle`, which holds the machinery (tiny float64 Hugging Face
checkpoints, transformers' greedy reference, combination enumeration and
`run_engine` with its integrity checks) so plugin authors share it."""

from __future__ import annotations

from servelab.testing.oracle import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    VARIANTS,
    VOCAB,
    OracleCase,
    combinations,
    combo_id,
    make_case,
    run_engine,
    variants,
)

__all__ = [
    "MAX_MODEL_LEN",
    "MAX_TOKENS",
    "PROMPTS",
    "VARIANTS",
    "VOCAB",
    "OracleCase",
    "combinations",
    "combo_id",
    "make_case",
    "run_engine",
    "variants",
]
