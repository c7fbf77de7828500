"""The drift scan (`eagle3pipe check`'s last part): hand-written architecture and serving values
in tracked files that contradict params.yaml and the configs it renders: assignments, mappings,
JSON inside shell strings, command-line flags in either spelling, Markdown code blocks and
notebook cells, for every value a consumer reads from the rendered configs.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from eagle3pipe.draft.formats import TRAINED_DTYPE
from eagle3pipe.tools.check import same

# every value a consumer reads from the rendered configs, by its canonical name, with the other
# names it goes by (each name is also matched kebab-case, camelCase, UPPER_CASE and as a --flag)
SCAN_KEYS = {
    "head_dim": (), "num_attention_heads": (), "num_key_value_heads": (), "hidden_size": (),
    "intermediate_size": (), "num_hidden_layers": (), "vocab_size": ("tokenizer_vocab_size",),
    "draft_vocab_size": (), "target_hidden_size": (), "max_position_embeddings": (),
    "verifier_num_layers": (), "aux_layer_ids": ("eagle_aux_hidden_state_layer_ids",),
    "norm_before_residual": (), "norm_before_fc": (), "fc_norm": (), "norm_output": (),
    "draft_arch": (),
    "use_aux_hidden_state": (), "rope_theta": (), "rope_type": (), "rope_scaling": (),
    "rms_norm_eps": (), "hidden_act": (), "tie_word_embeddings": (), "attention_bias": (),
    "mlp_bias": (), "bos_token_id": (), "eos_token_id": (),
    "num_speculative_tokens": ("speculative_tokens",), "dtype": ("torch_dtype",),
}
# not scanned, and why (tests assert SCAN_KEYS + NOT_SCANNED cover VLLM_READS and DraftArch)
NOT_SCANNED = {"architectures": "a class name, not a size", "model_type": "likewise",
               "layer_types": "not a params key: eagle3pipe's drafts attend to every position",
               "sliding_window": "likewise"}
SCAN_SUFFIXES = {".py", ".sh", ".bash", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini",
                 ".mk", ".md", ".ipynb"}
SCAN_NAMES = {"Makefile", "Dockerfile"}  # and extensionless scripts with a #! line
# generated (checked against params by check_rendered, or results), or fixtures with their own
# sizes (the test suite's micro and malformed inputs; examples/ each have their own params.yaml)
SCAN_EXEMPT = ("configs/", "metrics/", "plots/", "dvc.lock", "dvc.yaml", "requirements.lock",
               "bench/results.json", "tests/", "examples/")
SOURCE_NAME = "params.yaml"  # any params file is a source, not a copy
# speculative methods whose k is not the draft's (vLLM's hidden-state capture runs with k = 1)
OTHER_K_METHODS = ("extract_hidden_states",)
IGNORE = "check: ignore"
NULLS = ("null", "None", "~")
FIX = ("derive it from params.yaml or read it from configs/; a deliberate difference gets a "
       f"`{IGNORE}` comment on its line (or the line before its Markdown code block)")


def _spellings(n: str) -> set[str]:
    return {n, n.replace("_", "-"), re.sub(r"_(\w)", lambda m: m[1].upper(), n), n.upper()}


_CANONICAL = {s: key for key, aliases in SCAN_KEYS.items() for n in (key, *aliases)
              for s in _spellings(n)}
_KEYS = "|".join(sorted(map(re.escape, _CANONICAL), key=len, reverse=True))
_NUM = r"[-+]?(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_VALUE = r"""(?P<val> \[[^\]]*\] | \([^)]*\) | \{[^{}]*\}              # a list, an object
      | (?:\n[ \t]*-[ \t]*-?\d+[ \t]*(?=\n|$))+                       # a YAML block list
      | -?\d+(?:(?:[ \t]*,[ \t]*|[ \t]+)-?\d+)+(?![\w.])              # --ids 1 2 3, 1,2,3
      | \\?"[^"\\\n]*\\?" | '[^'\n]*'                                 # a string
      | %s(?:[ \t]*(?://|[*/+-])[ \t]*%s)*(?!\w)                      # a number or an expression
      | [A-Za-z_][\w.]* )
    (?P<more> [ \t]*(?:[*/%%@(\[]|\.\w|[-+][ \t]+[\w(]) )?            # ... of names: not constant
    """ % (_NUM, _NUM)
_PATTERNS = (re.compile(r"""
    (?<![\w-]) \\?["']? (?P<dash>--)? (?P<key>%s) (?![\w-]) \\?["']? \]?      # also x["key"]
    (?: [ \t]*:[ \t]*(?:[A-Za-z_][\w.\[\], |]*?[ \t]*=(?!=)[ \t]*)?   # key: v / key: T = v
      | [ \t]*=(?!=)[ \t]*                                            # key = v, --key=v
      | (?(dash)[ \t]+|(?!)) )                                        # --key v
    """ % _KEYS + _VALUE, re.VERBOSE), re.compile(r"""                 # argparse's default
    add_argument\(\s*["'](?P<dash>--)(?P<key>%s)["'][^)]*?\bdefault\s*=\s*""" % _KEYS + _VALUE,
    re.VERBOSE))
_NOVALUE = object()
# rope_scaling's stand-in for any object: the scan tells null from an object, no more
_OBJECT = type("_Object", (), {"__repr__": lambda self: "an object"})()
_Object = type(_OBJECT)


def _show(v: Any) -> str:
    return repr(list(v)) if isinstance(v, tuple) else repr(v)


def _leaves(obj: Any, path: str = ""):
    """(dotted path, leaf key, value) of a JSON document, through dicts and lists of dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
            if not isinstance(v, (dict, list)) or k in _CANONICAL:
                yield f"{path}.{k}" if path else k, k, v
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        for i, x in enumerate(obj):
            yield from _leaves(x, f"{path}[{i}]")


def allowed_values(params, rendered: dict[str, str], params_file: str = SOURCE_NAME
                   ) -> dict[str, dict[Any, str]]:
    """{canonical key: {value: its first source}} over params' draft, verifier.embedded and
    extract sections and every rendered config (configs/<file>: dotted key); the dtypes also
    allow training's float32 (formats.TRAINED_DTYPE) and vLLM's `auto` (the config's dtype)."""
    allowed: dict[str, dict[Any, str]] = {k: {} for k in SCAN_KEYS}

    def add(name: str, value: Any, source: str) -> None:
        key = _CANONICAL.get(name)
        if key is not None and (not isinstance(value, dict) or key == "rope_scaling"):
            allowed[key].setdefault(_OBJECT if isinstance(value, dict) else tuple(value)
                                    if isinstance(value, (list, tuple)) else value, source)

    for section, obj in (("draft", params.draft), ("verifier.embedded", params.verifier.embedded),
                         ("extract", params.extract)):
        for f in fields(obj) if is_dataclass(obj) else ():
            if getattr(obj, f.name) is not None:  # None in params: derived, not a value
                add(f.name, getattr(obj, f.name), f"{params_file} {section}.{f.name}")
    for rel, text in rendered.items():
        for path, key, value in _leaves(json.loads(text)):
            add(key, value, f"configs/{rel} {path}")
    add("dtype", TRAINED_DTYPE, "training's dtype (formats.TRAINED_DTYPE)")
    add("dtype", "auto", "vLLM's `auto`: the config's dtype")
    return allowed


def _parse(kind: type, raw: str, bare_ok: bool) -> Any:
    """The literal `raw` stands for, as a value of `kind`; _NOVALUE if it is not one."""
    if kind is _Object:
        return None if raw in NULLS else _OBJECT if raw[:1] == "{" and ":" in raw else _NOVALUE
    if kind is tuple:
        body = re.sub(r"^[ \t]*-", " ", raw, flags=re.M) if raw[:1] == "\n" else raw.strip("[]()")
        items = body.replace(",", " ").split()
        ok = items and all(re.fullmatch(r"-?\d+", i) for i in items)
        return tuple(int(i) for i in items) if ok else _NOVALUE
    if raw[:1] in "[({\n\"'\\":  # a string, unless a template ("${DTYPE}", "{dt}")
        text = raw.strip("\\\"'")
        return text if kind is str and raw[:1] not in "[({\n" and not re.search(r"[${}%]", text) \
            else _NOVALUE
    if raw in ("true", "True", "false", "False"):
        return raw in ("true", "True") if kind is bool else _NOVALUE
    if re.match(r"[-+.\d]", raw) and kind in (int, float):
        try:
            v = eval(compile(ast.parse(raw.replace("_", ""), mode="eval"), "<value>", "eval"),
                     {"__builtins__": {}})  # only numbers and operators: _PATTERN's val
            return v if kind is float or float(v).is_integer() else _NOVALUE
        except (SyntaxError, ValueError, ArithmeticError, TypeError):
            return _NOVALUE
    return raw if kind is str and bare_ok else _NOVALUE


def _kind(values: dict) -> type:
    kinds = {type(v) for v in values}
    if kinds <= {type(None), _Object}:
        return _Object
    kinds -= {type(None)}
    if kinds == {int, float}:
        return float
    return kinds.pop() if len(kinds) == 1 else object  # object: nothing parses as it


SHELL, YAML, CODE = "shell", "yaml", "code"
# a Markdown block's language (none: a shell session) or a file's suffix -> how it is read
_LANG = {"bash": SHELL, "sh": SHELL, "shell": SHELL, "console": SHELL, "zsh": SHELL, "": SHELL,
         "make": SHELL, "yaml": YAML, "yml": YAML, "ini": YAML, ".sh": SHELL, ".bash": SHELL,
         ".mk": SHELL, ".yaml": YAML, ".yml": YAML, ".cfg": YAML, ".ini": YAML}


@dataclass
class Segment:
    """Text scanned as a unit: `where` names the file (and notebook cell), `first` is the line
    number of its first line. `lang`: in shell and YAML a bare word is a value and `/` no
    operator; in code a value followed by an operator or a call is no constant."""
    where: str
    first: int
    text: str
    lang: str


def _lang(rel: str, text: str) -> str:
    p = Path(rel)
    if p.name in SCAN_NAMES or not p.suffix:  # Makefile, Dockerfile, a #! script
        return CODE if "python" in text.split("\n", 1)[0] else SHELL
    return _LANG.get(p.suffix, CODE)


def _markdown_blocks(rel: str, text: str) -> list[Segment]:
    """Fenced code blocks (``` or ~~~), unless the line before the fence says check: ignore;
    a block without a language is read as a shell session."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(m.group(1))), len(lines))
        if not (i and IGNORE in lines[i - 1]):
            out.append(Segment(rel, i + 2, "\n".join(lines[i + 1:end]),
                               _LANG.get(m.group(2).lower(), CODE)))
        i = end + 1
    return out


def segments(rel: str, text: str) -> list[Segment]:
    """What of a file is scanned: Markdown's code blocks, a notebook's code cells, else all;
    raises ValueError for a notebook that is not JSON."""
    if rel.endswith(".md"):
        return _markdown_blocks(rel, text)
    if rel.endswith(".ipynb"):
        nb = json.loads(text)
        if not isinstance(nb, dict) or not isinstance(nb.get("cells", []), list):
            raise ValueError("not a notebook object with a list of cells")
        return [Segment(f"{rel} (cell {n})", 1, "".join(c.get("source", "")), CODE)
                for n, c in enumerate(nb.get("cells", []), 1)
                if isinstance(c, dict) and c.get("cell_type") == "code"]
    return [Segment(rel, 1, text, _lang(rel, text))]


def _skipped(seg: Segment, m: re.Match, line_text: str) -> bool:
    """A deliberate or non-contradicting occurrence: an ignore comment, a params override
    (`dvc exp run -S draft.KEY=V`, `make exp SET="draft.KEY=V"`: it changes params.yaml, so
    every config follows), or the k of a speculative method that is not the draft's."""
    if IGNORE in line_text or seg.text.endswith(("draft.", "embedded."), 0, m.start("key")):
        return True
    key = _CANONICAL[m.group("key")]
    return key == "num_speculative_tokens" and any(x in line_text for x in OTHER_K_METHODS)


def _finding(seg: Segment, m: re.Match, allowed: dict) -> tuple[int, str] | None:
    """(line, problem) of one match of _PATTERNS, or None where it contradicts nothing."""
    key, values = _CANONICAL[m.group("key")], allowed[_CANONICAL[m.group("key")]]
    line = seg.text.count("\n", 0, m.start("key"))
    if not values or (m.group("more") and seg.lang == CODE) or \
            _skipped(seg, m, seg.text.split("\n")[line]):
        return None
    kind, raw = _kind(values), m.group("val")
    if kind is not tuple and re.fullmatch(r"-?\d+(?:[ \t,]+-?\d+)+", raw):
        raw = re.split(r"[ \t,]+", raw)[0]  # a flag's value followed by other words
    v = _parse(kind, raw, bool(m.group("dash")) or seg.lang != CODE)
    if v is _NOVALUE or any(same(v, a) for a in values):
        return None
    written = f"{m.group('dash') or ''}{m.group('key')}"
    say = " or ".join(f"{_show(a)} ({src})" for a, src in values.items())
    line += seg.first
    return line, (f"{seg.where}:{line}: {written}{'' if written == key else f' ({key})'} = "
                  f"{_show(v)} written by hand, but params and the rendered configs say "
                  f"{say}; fix: {FIX}")


def _matches(pattern: re.Pattern, seg: Segment):
    """Every match, each search resuming after the last key (keys inside an object value)."""
    pos = 0
    while (m := pattern.search(seg.text, pos)) is not None:
        yield m
        pos = m.end("key")


def tracked_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (subprocess.CalledProcessError, FileNotFoundError):
        out = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(f for f in out if f)


def _scanned(root: Path, rel: str, source: Path) -> bool:
    p = root / rel
    if rel.startswith(SCAN_EXEMPT) or p.name == SOURCE_NAME or not p.is_file() or \
            p.resolve() == source or (p.suffix and p.suffix not in SCAN_SUFFIXES):
        return False
    with open(p, "rb") as fh:
        return p.suffix in SCAN_SUFFIXES or p.name in SCAN_NAMES or fh.read(2) == b"#!"


def scan_constants(root: str | Path, params, rendered: dict[str, str], *,
                   params_file: str = SOURCE_NAME) -> list[str]:
    """Every architecture or serving value written by hand in a tracked file (see SCAN_KEYS,
    SCAN_SUFFIXES, SCAN_EXEMPT) that none of params' or the rendered configs' values for its
    key allows: `file:line: key = value ..., params and the rendered configs say ...; fix`."""
    root = Path(root)
    allowed = allowed_values(params, rendered, params_file)
    problems = []
    for rel in tracked_files(root):
        if not _scanned(root, rel, Path(params_file).resolve()):
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
            segs = segments(rel, text)
        except UnicodeDecodeError:
            continue
        except ValueError as e:  # json.JSONDecodeError: a notebook that is not JSON
            problems.append(f"{rel}:{getattr(e, 'lineno', 1)}: not a valid notebook ({e}); "
                            "fix: save it again from Jupyter")
            continue
        for seg in segs:
            found = (_finding(seg, m, allowed) for pat in _PATTERNS for m in _matches(pat, seg))
            problems += [msg for _, msg in sorted(f for f in found if f)]
    return problems
