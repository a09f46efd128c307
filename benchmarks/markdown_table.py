"""Turns a pytest-benchmark JSON file into the Markdown tables of README.md.

pytest benchmarks/ --benchmark-json=bench.json
python benchmarks/markdown_table.py bench.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

# the figure each group is read by, besides the timing
FIGURES = ("us_per_op", "us_per_step", "gflops", "output_tok_s", "ratio", "output_digest")


def rows_by_group(data: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for bench in data["benchmarks"]:
        groups[bench["group"] or "ungrouped"].append(bench)
    return groups


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if value >= 100 else f"{value:.3g}"
    return str(value).replace("|", " \\| ")  # a combination id's separators


def table(benches: list[dict]) -> str:
    figures = [f for f in FIGURES if any(f in b["extra_info"] for b in benches)]
    head = ["case", "median (ms)", "min (ms)", "rounds", *figures]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in sorted(benches, key=lambda b: b["stats"]["median"]):
        case = b["param"] or b["name"]
        stats = b["stats"]
        values = [b["extra_info"].get(f, "") for f in figures]
        row = [
            cell(case),
            cell(stats["median"] * 1e3),
            cell(stats["min"] * 1e3),
            str(stats["rounds"]),
        ]
        lines.append("| " + " | ".join(row + [cell(v) for v in values]) + " |")
    return "\n".join(lines)


def main(path: str) -> None:
    data = json.loads(open(path).read())
    machine = data["machine_info"]
    print(
        f"{data['datetime']} — {machine.get('cpu', {}).get('brand_raw', '?')}, "
        f"{machine.get('cpu', {}).get('count', '?')} cores, {machine.get('machine')}, "
        f"Python {machine.get('python_version')}\n"
    )
    for group, benches in sorted(rows_by_group(data).items()):
        print(f"### {group}\n\n{table(benches)}\n")
        for b in benches:
            extra = {k: v for k, v in b["extra_info"].items() if k not in FIGURES}
            if "transformers_tok_s" in extra:
                print(f"`{json.dumps(extra)}`\n")


if __name__ == "__main__":
    main(sys.argv[1])
