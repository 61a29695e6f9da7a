"""The import graph (`python -m tools.import_graph`): no import cycles, and the layering of
docs/architecture.md (`tools.import_graph.LAYERING`) kept, function-level imports included."""

from __future__ import annotations

import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `tools` is not installed; it runs from the checkout
    sys.path.insert(0, ROOT)

from tools import import_graph  # noqa: E402


@functools.lru_cache(maxsize=1)
def _repo_report() -> import_graph.Report:
    return import_graph.check(ROOT)


def test_the_repository_has_no_import_cycle_and_keeps_its_layering():
    report = _repo_report()
    assert report.ok, import_graph.format_problems(report)


def test_the_graph_reads_every_package():
    graph = _repo_report().graph
    for module in ("serving.core.engine", "model.config", "sharding.layout", "kernels_pallas.reference"):
        assert module in graph
    assert "model.config" in graph["model.families"]  # a module-level import
    assert "kernels_pallas" in graph["model.forward"]


# --- the checks themselves, on small packages written for them -------------------------------------


def _write(root, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    root = _write(tmp_path, {
        "model/__init__.py": "",
        "model/a.py": "from model.b import g\n\ndef f():\n    return g()\n",
        "model/b.py": "def g():\n    from model.a import f  # deferred, still a dependency\n    return f\n",
        "model/c.py": "import model.a\n",  # imports into the cycle, not part of it
    })
    report = import_graph.check(root, packages=("model",), rules=None)
    assert report.cycles == [["model.a", "model.b"]]
    assert not report.ok
    assert import_graph.cycle_path(report.graph, report.cycles[0]) == ["model.a", "model.b", "model.a"]
    assert report.graph["model.b"]["model.a"][0].deferred
    assert "import cycle among 2 modules: model.a, model.b" in import_graph.format_problems(report)


def test_an_acyclic_package_passes(tmp_path):
    root = _write(tmp_path, {
        "model/__init__.py": "",
        "model/a.py": "import os\nfrom model import b\n",
        "model/b.py": "def g():\n    import model.c\n",
        "model/c.py": "",
    })
    report = import_graph.check(root, packages=("model",), rules=None)
    assert report.ok and report.graph == {
        "model": {}, "model.a": {"model.b": [import_graph.Import("model.b", 2, False)]},
        "model.b": {"model.c": [import_graph.Import("model.c", 2, True)]}, "model.c": {}}


def test_layering_violations_are_found(tmp_path):
    root = _write(tmp_path, {
        "kernels_pallas/__init__.py": "",
        "kernels_pallas/k.py": "def f():\n    from model.config import X\n",
        "model/__init__.py": "",
        "model/config.py": "X = 1\n",
        "serving/__init__.py": "",
        "serving/core/__init__.py": "",
        "serving/core/engine.py": "from serving.spec_decode.proposer import P\nfrom model.config import X\n",
        "serving/spec_decode/__init__.py": "",
        "serving/spec_decode/proposer.py": "from serving.core import engine\n",
    })
    report = import_graph.check(root)
    found = {(v.importer, v.imp.target, v.rule.importer) for v in report.violations}
    assert found == {("kernels_pallas.k", "model.config", "kernels_pallas"),
                     ("serving.core.engine", "serving.spec_decode.proposer", "serving.core")}
    assert report.cycles == [["serving.core.engine", "serving.spec_decode.proposer"]]


def test_lazy_exports_and_relative_imports_resolve_to_the_defining_module(tmp_path):
    root = _write(tmp_path, {
        "serving/__init__.py": ('from model.lazy_exports import lazy_exports\n'
                                '_EXPORTS = {"LLM": "serving.llm", **dict.fromkeys(("A", "B"), "serving.core.x")}\n'
                                '__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)\n'),
        "serving/llm.py": "from .core import x\nfrom .core.x import A\n",
        "serving/core/__init__.py": "",
        "serving/core/x.py": "A = B = 1\n",
        "serving/server.py": "from serving import LLM, B\n",
        "model/__init__.py": "",
        "model/lazy_exports.py": "def lazy_exports(package, exports):\n    return None, None\n",
    })
    graph = import_graph.check(root).graph
    assert set(graph["serving"]) == {"model.lazy_exports"}  # the table itself imports nothing
    assert set(graph["serving.server"]) == {"serving.llm", "serving.core.x"}
    assert set(graph["serving.llm"]) == {"serving.core.x"}


def test_main_prints_the_graph_and_exits_non_zero_on_a_problem(tmp_path, capsys):
    clean = _write(tmp_path / "clean", {"model/__init__.py": "", "model/a.py": "from model import b\n",
                                        "model/b.py": ""})
    assert import_graph.main(["--root", clean]) == 0
    assert "model.a\n    -> model.b" in capsys.readouterr().out
    assert import_graph.main(["--root", clean, "--format=dot"]) == 0
    assert '"model.a" -> "model.b";' in capsys.readouterr().out

    cyclic = _write(tmp_path / "cyclic", {"model/__init__.py": "", "model/a.py": "from model import b\n",
                                          "model/b.py": "from model import a\n"})
    assert import_graph.main(["--root", cyclic, "--check"]) == 1
    assert "import cycle among 2 modules: model.a, model.b" in capsys.readouterr().err
