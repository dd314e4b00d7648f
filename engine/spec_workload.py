"""The code-editing workload of speculative decoding's benchmarks (`nanoqwen bench --spec`,
benchmarks/bench_spec.py; issue 13 item 4): twelve requests that rewrite code given in the
prompt (type hints, renames, docstrings, a bug fix, f-strings, ...) -- the replies a coding
assistant mostly gives, where much of the answer repeats the prompt -- and four that write new
code. Chat-formatted by the model's own tokenizer.
"""

from __future__ import annotations

CODE_A = '''def load_rows(path, sep):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rows.append(line.split(sep))
    return rows
'''
CODE_B = '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]
'''
CODE_C = '''def describe(name, age, city):
    return "Name: " + name + ", age: " + str(age) + ", city: " + city


def greet(name):
    return "Hello, " + name + "!"
'''
CODE_D = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs) + 1
'''
EDITS = [
    ("Add type hints to this function:", CODE_A),
    ("Add a docstring to this function:", CODE_A),
    ("Rename `rows` to `records` in this code:", CODE_A),
    ("Make `sep` default to a comma:", CODE_A),
    ("Add type hints to this class:", CODE_B),
    ("Add docstrings to every method of this class:", CODE_B),
    ("Rename `counts` to `tally` in this class:", CODE_B),
    ("Add a `reset` method to this class:", CODE_B),
    ("Rewrite these functions with f-strings:", CODE_C),
    ("Add type hints to these functions:", CODE_C),
    ("Fix the bug in this function:", CODE_D),
    ("Make this function return 0.0 for an empty list:", CODE_D),
]
NEW = ["Write a Python function that checks whether a string is a palindrome.",
       "Write a function that returns the n-th Fibonacci number.",
       "Write a function that flattens a nested list.",
       "Write a class for a stack with push, pop and peek."]


def requests() -> list[tuple[str, str]]:
    """(kind, text) per request: kind "edit" (the twelve) or "new" (the four)."""
    out = [("edit", f"{ask}\n\n```python\n{code}```") for ask, code in EDITS]
    return out + [("new", text) for text in NEW]
