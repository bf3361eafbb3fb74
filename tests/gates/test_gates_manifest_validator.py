"""The manifest validator: every problem named at once, nothing accepted that the schema lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
from throwaway_suite import ThrowawaySuite, gate_entry

from gates.runner import GateRunError, load_manifest
from gates.runner.fixture_needs import catalog
from gates.runner.manifest import DEFAULT_TIMEOUT_S, suite_root

REPO_ROOT = Path(__file__).resolve().parents[2]


def problems_of(path: Path) -> list[str]:
    with pytest.raises(GateRunError) as caught:
        load_manifest(path)
    assert caught.value.stage == "manifest"
    return [str(problem) for problem in caught.value.problems]


def test_the_documented_format_loads(suite: ThrowawaySuite) -> None:
    # The format manifests/kernels.toml is written in, verbatim apart from the names.
    suite.gates_dir = "gates/kernels"
    suite.name = "kernels"
    test = suite.write_module("test_prep_gpu.py", "def test_gemma4_global_matches_spec():\n    pass\n")
    suite.write_manifest(
        [
            gate_entry(
                "kernels.prep_gemma4_global_matches_spec",
                f"{test}::test_gemma4_global_matches_spec",
                invariant="numeric-parity",
                needs=["gpu"],
                timeout_s=300,
            )
        ]
    )
    manifest = load_manifest(suite.manifest)
    assert manifest.suite.name == "kernels"
    assert manifest.suite.root == suite.root.resolve()
    assert manifest.suite.gates_dir == (suite.root / "gates" / "kernels").resolve()
    [gate] = manifest.gates
    assert (gate.id, gate.invariant, gate.needs, gate.timeout_s) == (
        "kernels.prep_gemma4_global_matches_spec",
        "numeric-parity",
        ("gpu",),
        300,
    )
    assert manifest.base_needs(gate) == {"gpu"}


def test_timeout_defaults_when_omitted(suite: ThrowawaySuite) -> None:
    suite.write_manifest([gate_entry("demo.a", "suite_gates/test_a.py::test_a")])
    assert load_manifest(suite.manifest).gates[0].timeout_s == DEFAULT_TIMEOUT_S


def test_unknown_keys_are_named_at_every_level(suite: ThrowawaySuite) -> None:
    suite.write_manifest(
        [gate_entry("demo.a", "suite_gates/test_a.py::test_a", retries=3)],
        suite_extra={"owner": "me"},
        top_extra='\n[extras]\ncolour = "blue"\n',
    )
    problems = problems_of(suite.manifest)
    assert any("unknown key 'retries'" in p and p.startswith("gate demo.a") for p in problems)
    assert any("unknown key 'owner'" in p and p.startswith("[suite]") for p in problems)
    assert any("unknown key 'extras'" in p for p in problems)
    assert len(problems) == 3


def test_duplicate_ids_and_test_nodes_are_named(suite: ThrowawaySuite) -> None:
    suite.write_manifest(
        [
            gate_entry("demo.a", "suite_gates/test_a.py::test_a"),
            gate_entry("demo.a", "suite_gates/test_a.py::test_b"),
            gate_entry("demo.c", "suite_gates/test_a.py::test_b"),
        ]
    )
    problems = problems_of(suite.manifest)
    assert "demo.a: duplicate id: [[gate]] #1 and #2" in problems
    assert "suite_gates/test_a.py::test_b: duplicate test node: [[gate]] #2 and #3" in problems


def test_unknown_needs_and_invariants_are_named_with_what_is_known(suite: ThrowawaySuite) -> None:
    suite.write_manifest(
        [
            gate_entry("demo.a", "suite_gates/test_a.py::test_a", needs=["gpu", "tpu"]),
            gate_entry("demo.b", "suite_gates/test_a.py::test_b", invariant="vibes"),
            gate_entry("demo.c", "suite_gates/test_a.py::test_c", needs=["gpu", "gpu"]),
        ]
    )
    problems = problems_of(suite.manifest)
    [tpu] = [p for p in problems if "'tpu'" in p]
    assert tpu.startswith("gate demo.a: unknown need 'tpu'") and "checkpoint, gpu, hf-reference" in tpu
    assert any(
        p.startswith("gate demo.b: unknown invariant 'vibes'") and "numeric-parity" in p for p in problems
    )
    assert any(p.startswith("gate demo.c: need 'gpu' is listed twice") for p in problems)


def test_field_values_are_checked(suite: ThrowawaySuite) -> None:
    suite.write_manifest(
        [
            gate_entry("other.a", "suite_gates/test_a.py::test_a"),
            gate_entry("demo.b", "suite_gates/test_a.py", timeout_s=0),
            gate_entry("demo.c", "elsewhere/test_c.py::test_c", why=""),
            gate_entry("demo.d", "suite_gates/test_d.py::test_d", timeout_s=True),
        ]
    )
    problems = problems_of(suite.manifest)
    assert any(p.startswith("gate other.a: id must start with the suite name") for p in problems)
    assert any(p.startswith("gate demo.b: test must be a pytest node id") for p in problems)
    assert any(p.startswith("gate demo.b: timeout_s must be whole seconds") for p in problems)
    assert any(p.startswith("gate demo.c: test elsewhere/test_c.py::test_c lies outside") for p in problems)
    assert any(p.startswith("gate demo.c: why must be one non-empty line") for p in problems)
    assert any(p.startswith("gate demo.d: timeout_s must be whole seconds") for p in problems)
    assert len(problems) == 6


def test_suite_table_is_checked(suite: ThrowawaySuite) -> None:
    suite.manifest.parent.mkdir(parents=True)
    suite.manifest.write_text('[suite]\nname = "Demo Suite"\ngates_dir = "../outside"\n')
    problems = problems_of(suite.manifest)
    assert any(p.startswith("[suite].name: must be a lower-case name") for p in problems)
    assert any(p.startswith("[suite].model_types: must be a list") for p in problems)
    assert any(p.startswith("[suite].gates_dir:") and "outside the suite root" in p for p in problems)


def test_a_checkpoint_need_requires_model_types(suite: ThrowawaySuite) -> None:
    suite.write_manifest([gate_entry("demo.a", "suite_gates/test_a.py::test_a", needs=["checkpoint"])])
    assert problems_of(suite.manifest) == ["gate demo.a: needs a checkpoint but [suite].model_types is empty"]


def test_invalid_toml_is_one_named_problem(suite: ThrowawaySuite) -> None:
    suite.manifest.parent.mkdir(parents=True)
    suite.manifest.write_text("[suite\n")
    [problem] = problems_of(suite.manifest)
    assert "is not valid TOML" in problem


def test_named_fixture_needs_come_from_conftest_declarations(suite: ThrowawaySuite) -> None:
    suite.write_module(
        "conftest.py",
        """
        import pytest

        GATE_FIXTURE_NEEDS = {"reference_model": ("checkpoint", "hf-reference"), "scratch": ()}

        @pytest.fixture
        def reference_model():
            return None

        @pytest.fixture(name="scratch")
        def make_scratch():
            return None
        """,
    )
    suite.write_manifest(
        [
            gate_entry("demo.a", "suite_gates/test_a.py::test_a", needs=["reference_model", "gpu"]),
            gate_entry("demo.b", "suite_gates/test_a.py::test_b", needs=["scratch"]),
        ],
        model_types=["qwen3"],
    )
    manifest = load_manifest(suite.manifest)
    first, second = manifest.gates
    assert manifest.base_needs(first) == {"checkpoint", "hf-reference", "gpu"}
    assert manifest.base_needs(second) == frozenset()


def test_bad_fixture_declarations_are_named(suite: ThrowawaySuite) -> None:
    suite.write_module(
        "conftest.py",
        """
        import pytest

        GATE_FIXTURE_NEEDS = {"ghost": ("gpu",), "real": ("tpu",)}

        @pytest.fixture
        def real():
            return None
        """,
    )
    suite.write_manifest([gate_entry("demo.a", "suite_gates/test_a.py::test_a", needs=["ghost"])])
    problems = problems_of(suite.manifest)
    assert any(
        "GATE_FIXTURE_NEEDS['ghost']: names a fixture this conftest does not define" in p for p in problems
    )
    assert any("GATE_FIXTURE_NEEDS['real']: implies unknown needs ['tpu']" in p for p in problems)
    assert any(p.startswith("gate demo.a: unknown need 'ghost'") for p in problems)


def test_the_shared_gate_conftest_declares_its_fixtures() -> None:
    found, problems = catalog(REPO_ROOT, REPO_ROOT / "gates")
    assert problems == []
    assert {name: need.implies for name, need in found.items()} == {
        "checkpoint_path": ("checkpoint",),
        "checkpoint_config": ("checkpoint",),
        "cuda_device": ("gpu",),
    }


def test_suite_root_is_above_a_manifests_folder(tmp_path: Path) -> None:
    assert suite_root(tmp_path / "manifests" / "x.toml") == tmp_path.resolve()
    assert suite_root(tmp_path / "elsewhere" / "x.toml") == (tmp_path / "elsewhere").resolve()
