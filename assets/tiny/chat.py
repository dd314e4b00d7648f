"""Chat examples from documented Python functions, and the ChatML the model is trained on.

A function with a docstring becomes an exchange: the user asks for it by its signature and
the docstring's summary (one of several phrasings, some without the signature, so plain
"write a function that ..." requests work too); the assistant answers with the function in
a fenced ```python block, its docstring cut to that summary (shorter answers, the same
information as the request). `render` writes exactly what CHAT_TEMPLATE renders.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import textwrap

SYSTEM_PROMPT = ("You are a helpful coding assistant. You answer with Python code in a "
                 "```python block.")

# ChatML as Qwen2.5's template writes it (no tools), with our default system prompt.
CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MAX_CHARS = 900        # longest function answer used for training
TEST_MAX_CHARS = 450   # longest reference answer among the CPU test's held-out requests
OTHER_SYSTEMS = ["You are a helpful assistant.", "You are an expert Python programmer.",
                 "Answer with code only."]


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    s = ""
    if not messages or messages[0]["role"] != "system":
        s += f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
    for m in messages:
        s += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    if add_generation_prompt:
        s += "<|im_start|>assistant\n"
    return s


def code_key(code: str) -> str:
    return hashlib.sha1(re.sub(r"\s+", "", code).encode()).hexdigest()


def _trivial(body: list[ast.stmt]) -> bool:
    if not body:
        return True
    if len(body) == 1:
        s = body[0]
        if isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)):
            return True
        if isinstance(s, ast.Raise):
            return True
    return False


def extract_functions(text: str, tree: ast.Module | None = None) -> list[dict]:
    """Documented, non-trivial module-level functions and methods of one file."""
    tree = tree or ast.parse(text)
    lines = text.split("\n")
    out = []
    nodes = []
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append(n)
        elif isinstance(n, ast.ClassDef):
            nodes += [m for m in n.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for n in nodes:
        if n.name.startswith("__") or n.decorator_list and not all(
                isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod", "property")
                for d in n.decorator_list):
            continue
        doc = ast.get_docstring(n, clean=True)
        if not doc or _trivial(n.body[1:]):
            continue
        summary = " ".join(doc.split("\n\n")[0].split())
        if not 15 <= len(summary) <= 240 or '"""' in summary or "\\" in summary \
                or summary.startswith((">>>", ":", "..", "Deprecated", "DEPRECATED")):
            continue
        ds = n.body[0]
        start = min([n.lineno] + [d.lineno for d in n.decorator_list]) - 1
        pre = lines[start:ds.lineno - 1]
        indent = " " * ds.col_offset
        wrapped = textwrap.fill(summary, width=88 - len(indent) - 3, break_on_hyphens=False,
                                break_long_words=False)
        new_doc = [indent + '"""' + wrapped.replace("\n", "\n" + indent) + '"""']
        new_doc = "\n".join(new_doc).split("\n")
        post = lines[ds.end_lineno:n.end_lineno]
        code = textwrap.dedent("\n".join(pre + new_doc + post)).strip("\n")
        if len(code) > MAX_CHARS or code.count("\n") < 3:
            continue
        try:
            ast.parse(code)
        except SyntaxError:
            continue
        sig = f"def {n.name}({ast.unparse(n.args)})"
        if n.returns is not None:
            sig += f" -> {ast.unparse(n.returns)}"
        if isinstance(n, ast.AsyncFunctionDef):
            sig = "async " + sig
        out.append({"name": n.name, "sig": sig, "summary": summary, "code": code})
    return out


def _lc_verb(summary: str) -> str:
    """'Returns the sum.' -> 'return the sum' (crude, for 'a function to ...')."""
    s = summary.rstrip(".")
    w, _, rest = s.partition(" ")
    if w[:1].isupper() and w[1:].islower():
        w = w.lower()
        if w.endswith("s") and not w.endswith("ss") and len(w) > 3:
            w = w[:-1]
    return (w + " " + rest).strip()


PHRASINGS = [
    lambda f: f"Write a Python function `{f['sig']}`. {f['summary']}",
    lambda f: f"Write a Python function to {_lc_verb(f['summary'])}.",
    lambda f: f"Implement this function:\n\n```python\n{f['sig']}:\n    \"\"\"{f['summary']}\"\"\"\n```",
    lambda f: f"Complete the following Python code.\n```python\n{f['sig']}:\n    \"\"\"{f['summary']}\"\"\"\n```",
    lambda f: f"{f['summary']} Write this as `{f['name']}` in Python.",
    lambda f: f"Can you write a function called {f['name']}? It should {_lc_verb(f['summary'])}.",
    lambda f: f"I need a Python function named `{f['name']}` with the signature `{f['sig']}`.\n{f['summary']}",
    lambda f: f"python: {f['sig']}\n{f['summary']}",
    lambda f: f"How would I write a function that does this in Python: {f['summary']}",
    lambda f: f"Write `{f['name']}`: {f['summary']}",
]


def request(f: dict, rng: random.Random) -> str:
    return rng.choice(PHRASINGS)(f)


def answer(f: dict, rng: random.Random) -> str:
    block = f"```python\n{f['code']}\n```"
    r = rng.random()
    if r < 0.6:
        return block
    if r < 0.85:
        return f"Here is `{f['name']}`:\n\n{block}"
    return f"{block}\n\nThe function `{f['name']}` does this: {f['summary']}"


def conversations(fns: list[dict], copies: int, rng: random.Random, multi: bool = True) -> list[str]:
    """`copies` rendered conversations per function (each a fresh phrasing); with `multi`,
    about one in ten carries a second exchange about another function of the same file."""
    out = []
    for _ in range(copies):
        for i, f in enumerate(fns):
            msgs = []
            r = rng.random()
            if r < 0.1:
                msgs.append({"role": "system", "content": rng.choice(OTHER_SYSTEMS)})
            elif r < 0.2:
                msgs.append({"role": "system", "content": SYSTEM_PROMPT})
            msgs += [{"role": "user", "content": request(f, rng)},
                     {"role": "assistant", "content": answer(f, rng)}]
            if multi and len(fns) > 1 and rng.random() < 0.1:
                g = fns[(i + 1) % len(fns)]
                msgs += [{"role": "user", "content": request(g, rng)},
                         {"role": "assistant", "content": answer(g, rng)}]
            out.append(render(msgs))
    return out
