"""The library `topoep` stands without the research code beside it: no module of topoep imports topoep_research
(statically, in any form, nor at run time), and policy "joint" exists for `topoep.solve` once
`import topoep_research` registered it. The run-time checks run in fresh interpreters (this process may have
imported topoep_research already)."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESEARCH = "topoep_research"


def _names_research(name: object) -> bool:
    return isinstance(name, str) and (name == RESEARCH or name.startswith(RESEARCH + "."))


def research_imports(tree: ast.AST) -> list[int]:
    """Line numbers of the imports of topoep_research in a module: import statements (also inside functions)
    and importlib.import_module / __import__ calls with a literal name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hit = any(_names_research(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            hit = node.level == 0 and _names_research(node.module)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            hit = (name in ("import_module", "__import__") and bool(node.args)
                   and isinstance(node.args[0], ast.Constant) and _names_research(node.args[0].value))
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return sorted(lines)


def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports this checkout's packages."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_research_imports_finds_every_form():
    code = textwrap.dedent("""
        import topoep_research
        import topoep_research.sim as sim
        from topoep_research import joint
        from topoep_research.milp import solve_milp
        def f():
            import importlib
            importlib.import_module("topoep_research.bound")
            __import__("topoep_research")
        import topoep_researcher, topoep.planners
        from topoep import research
        from . import topoep_research
    """)
    assert research_imports(ast.parse(code)) == [2, 3, 4, 5, 8, 9]


def test_no_library_module_imports_the_research_package():
    files = sorted((ROOT / "topoep").rglob("*.py"))
    assert ROOT / "topoep" / "planners" / "__init__.py" in files
    found = {f.relative_to(ROOT).as_posix(): lines for f in files
             if (lines := research_imports(ast.parse(f.read_text(), filename=str(f))))}
    assert not found, f"topoep imports topoep_research at (file: lines) {found}"


def test_importing_every_library_module_leaves_the_research_package_unimported():
    out = run_python(f"""
        import importlib, pkgutil, sys
        from pathlib import Path

        import topoep

        assert Path(topoep.__file__).resolve().parent == Path({str(ROOT / "topoep")!r}), topoep.__file__
        names = [m.name for m in pkgutil.walk_packages(topoep.__path__, "topoep.")]
        for name in names:
            importlib.import_module(name)
        assert {RESEARCH!r} not in sys.modules, sorted(m for m in sys.modules if m.startswith({RESEARCH!r}))
        print(" ".join(names))
    """)
    names = out.stdout.split()
    for name in ("topoep.planners.cuda", "topoep.runtime.moe", "topoep.megatron.moe_layer", "topoep.memory"):
        assert name in names


def test_joint_is_solved_once_the_research_package_registered_it():
    run_python("""
        import torch

        import topoep
        from topoep import Topology, solve

        omega = torch.tensor([[5, 0, 1, 0], [4, 1, 0, 0], [6, 0, 0, 1], [3, 0, 2, 0]], dtype=torch.int64).repeat(1, 2)
        topo = Topology(num_domains=2, ranks_per_domain=2)
        try:
            solve(omega, topo, num_slots=1, policy="joint")
        except ValueError as err:
            assert "import topoep_research" in str(err), err
        else:
            raise AssertionError("policy 'joint' was solved without topoep_research")

        import topoep_research
        from topoep_research.joint import solve_joint

        plan = solve(omega, topo, num_slots=1, policy="joint", t_ffn=1e-6).check()
        assert plan.policy == "joint" and "joint" in topoep.OFFLINE_POLICIES
        direct = solve_joint(omega, topo, num_slots=1, main_rank=plan.main_rank, expert_bytes=plan.expert_bytes,
                             token_bytes=plan.token_bytes, t_ffn=1e-6)
        assert torch.equal(plan.route, direct.route) and torch.equal(plan.slot_expert, direct.slot_expert)
    """)
