"""Print a `nanoqwen bench --spec --json` file as its table (engine/bench.py format_spec_table).

    python benchmarks/spec_rows.py FILE.json
"""
import json
import sys

from nanoqwen.engine.bench import format_spec_table

if __name__ == "__main__":
    d = json.load(open(sys.argv[1]))
    print(f"# {d['source']} on {d['device']}, spec {d['spec']}, commit {d['commit']}")
    print(format_spec_table(d["rows"]))
