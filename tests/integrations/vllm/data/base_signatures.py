"""Record vLLM's KV connector base classes' method signatures as JSON, read from source (vLLM never imported).

vLLM 0.33 ships as a CUDA build only, so kvdi's checks against its connector contract read a
small fixture extracted from the sdist (``base_v033_signatures.json`` beside this file)
instead of importing it. Regenerate it (vLLM itself is never installed)::

    mkdir -p /tmp/v033 && cd /tmp/v033
    pip download --no-deps --no-binary :all: --no-build-isolation --no-clean vllm==0.33.0
    # pip fails at metadata (no CUDA toolchain) after unpacking; --no-clean keeps the unpacked tree:
    # /tmp/pip-download-*/vllm_*/ holds vllm/distributed/kv_transfer/kv_connector/v1/base.py
    python -m tests.integrations.vllm.data.base_signatures \\
        /tmp/pip-download-*/vllm_*/vllm/distributed/kv_transfer/kv_connector/v1/base.py 0.33.0 \\
        > tests/integrations/vllm/data/base_v033_signatures.json

``signatures_of_class`` gives the same record for a live class (vLLM 0.32 in ``.venv-vllm``),
so one comparison (:func:`mismatches`) checks kvdi's connector against either.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path
from typing import Any

CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
FIXTURE = Path(__file__).with_name("base_v033_signatures.json")

Signature = dict[str, Any]  # {"kind": ..., "abstract": bool, "params": [[name, kind, has_default], ...]}


def _kind_of(decorators: list[str]) -> str:
    for kind in ("classmethod", "staticmethod", "property"):
        if kind in decorators:
            return kind
    return "method"


def _params_of(args: ast.arguments) -> list[list[Any]]:
    positional = [*args.posonlyargs, *args.args]
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    out: list[list[Any]] = [[a.arg, "positional", d] for a, d in zip(positional, defaults, strict=True)]
    if args.vararg is not None:
        out.append([args.vararg.arg, "var_positional", False])
    for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append([a.arg, "keyword_only", default is not None])
    if args.kwarg is not None:
        out.append([args.kwarg.arg, "var_keyword", False])
    return out[1:] if out and out[0][0] in ("self", "cls") else out


def signatures_of_source(source: str) -> dict[str, dict[str, Signature]]:
    """``{class: {method: signature}}`` of :data:`CLASSES` in a ``base.py`` source."""
    tree = ast.parse(source)
    found: dict[str, dict[str, Signature]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            methods: dict[str, Signature] = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in item.decorator_list]
                    methods[item.name] = {
                        "kind": _kind_of(names),
                        "abstract": "abstractmethod" in names,
                        "params": _params_of(item.args),
                    }
            found[node.name] = methods
    return found


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def signature_of(cls: type, name: str) -> Signature:
    """The record of ``cls``'s own or inherited attribute ``name`` (a live class)."""
    raw = inspect.getattr_static(cls, name)
    kind = _kind_of([type(raw).__name__])
    func = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
    params = [
        [p.name, _KINDS[p.kind], p.default is not inspect.Parameter.empty]
        for p in inspect.signature(func).parameters.values()
    ]
    if params and params[0][0] in ("self", "cls"):
        params = params[1:]
    return {"kind": kind, "abstract": bool(getattr(func, "__isabstractmethod__", False)), "params": params}


def signatures_of_class(cls: type) -> dict[str, Signature]:
    """The record of every function, classmethod and property ``cls`` defines itself (a live class)."""
    return {
        name: signature_of(cls, name)
        for name, raw in vars(cls).items()
        if inspect.isfunction(raw) or isinstance(raw, classmethod | staticmethod | property)
    }


def mismatches(base: Signature, mine: Signature) -> list[str]:
    """Why ``mine`` (an override) cannot stand in for ``base``: kind, parameters vLLM passes, required extras."""
    problems: list[str] = []
    if base["kind"] != mine["kind"]:
        problems.append(f"kind {mine['kind']}, base {base['kind']}")
    if base["kind"] == "property":
        return problems
    mine_kinds = {p[0]: p[1] for p in mine["params"]}
    takes_kwargs = any(p[1] == "var_keyword" for p in mine["params"])
    base_positional = [p[0] for p in base["params"] if p[1] == "positional"]
    mine_positional = [p[0] for p in mine["params"] if p[1] == "positional"]
    if mine_positional[: len(base_positional)] != base_positional:
        problems.append(f"positional parameters {mine_positional}, base {base_positional}")
    for name, kind, _default in base["params"]:
        if kind == "var_keyword" and not takes_kwargs:
            problems.append("no **kwargs, base has them")
        elif kind == "keyword_only" and name not in mine_kinds and not takes_kwargs:
            problems.append(f"no parameter {name!r}")
    base_names = {p[0] for p in base["params"]}
    for name, kind, default in mine["params"]:
        if name not in base_names and kind in ("positional", "keyword_only") and not default:
            problems.append(f"required parameter {name!r} the base does not pass")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.integrations.vllm.data.base_signatures <base.py> <vllm version>", file=sys.stderr)
        return 2
    path, version = argv
    record = {"vllm": version, "source": "vllm/distributed/kv_transfer/kv_connector/v1/base.py"}
    record["classes"] = signatures_of_source(Path(path).read_text())  # type: ignore[assignment]
    print(json.dumps(record, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
