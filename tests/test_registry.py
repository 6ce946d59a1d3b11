"""The registry: built-ins, entry points, module:object, failing and duplicate plugins."""
from __future__ import annotations

import pytest

import mha_harness
from mha_harness.registry import RegistryError, builtin_entry_points, load_registry


def test_builtins_include_every_backend_the_product_promises():
    names = load_registry(entry_points=False).names()
    for name in ("numpy-naive", "numpy-tiled", "torch-eager", "torch-sdpa-math-cpu", "torch-sdpa-flash-cpu",
                 "torch-sdpa-efficient-cuda", "torch-sdpa-cudnn-cuda", "torch-nn-mha", "jax-explicit", "jax-dpa",
                 "jax-dpa-cudnn-gpu", "flax-mha", "onnxruntime-cpu", "torch-flex-cpu", "torch-flex-cuda",
                 "torch-compile-cpu"):
        assert name in names


def test_numpy_backends_are_available_and_gpu_variants_say_why_not():
    registry = load_registry()
    assert registry.get("numpy-naive").available and registry.get("numpy-tiled").available
    import importlib.util
    if importlib.util.find_spec("torch"):
        import torch
        if not torch.cuda.is_available():
            assert "no CUDA device" in registry.get("torch-sdpa-flash-cuda").reason_unavailable


def test_the_builtins_are_the_entry_points_of_mha_harness_itself():
    """One list of built-in backends: pyproject.toml's entry points, loaded as built-ins and not a second time as
    plugins."""
    values = {ep.value for ep in builtin_entry_points()}
    assert "mha_harness.implementations.numpy_naive:NumpyNaive" in values
    assert all(v.startswith("mha_harness.implementations.") for v in values)
    registry = load_registry()
    assert registry.get("numpy-naive").source == "built-in mha_harness.implementations.numpy_naive:NumpyNaive"
    assert load_registry(builtins=False, entry_points=False).names() == []


def test_module_object_spec_loads_instances_classes_and_factories():
    registry = load_registry(["tests.plugin_objects:LessonFunction", "tests.plugin_objects:RenamedNaive",
                              "tests.plugin_objects:two_backends"], entry_points=False)
    assert {"lesson-function", "my-naive", "other-naive", "lesson-function-2"} <= set(registry.names())
    assert registry.get("my-naive").source.startswith("--backend-spec")


def test_a_plugin_that_fails_to_import_is_recorded_and_does_not_abort():
    registry = load_registry(["tests.hostile_import:Backend"], entry_points=False)
    entry = registry.get("tests.hostile_import:Backend")
    assert entry.backend is None and "ImportError: hostile plugin" in entry.error
    assert registry.get("numpy-naive").available


def test_a_missing_attribute_is_recorded_with_its_error():
    entry = load_registry(["tests.plugin_objects:Nothing"], entry_points=False).get("tests.plugin_objects:Nothing")
    assert "AttributeError" in entry.error


def _with_entry_points(monkeypatch, *pairs):
    """The installed entry points plus fake third-party ones (name, value) in mha-harness's group."""
    from importlib import metadata

    from mha_harness import registry
    real = metadata.entry_points
    fake = [metadata.EntryPoint(name, value, registry.ENTRY_POINT_GROUP) for name, value in pairs]
    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda **kw: list(real(**kw)) + (fake if kw.get("group") == registry.ENTRY_POINT_GROUP else []))


def test_an_entry_point_that_fails_to_load_is_listed_under_the_entry_points_own_name(monkeypatch):
    """Its users pass the entry point's name to --backend: the failure is found there (it was named by its spec,
    and --backend my-attn said 'did you mean' the spec)."""
    _with_entry_points(monkeypatch, ("my-attn", "tests.plugin_objects:Nothing"),
                       ("numpy-naive", "tests.plugin_objects:NothingElse"))
    registry = load_registry()
    entry = registry.get("my-attn")
    assert entry.backend is None and "AttributeError" in entry.error and entry.spec == "tests.plugin_objects:Nothing"
    # a failed entry point whose name a backend holds is named by its spec, and the registry still loads
    assert registry.get("numpy-naive").available
    assert registry.get("tests.plugin_objects:NothingElse").backend is None


def test_a_project_folder_shadowing_the_plugin_is_named_as_a_namespace_package(tmp_path):
    """A plugin's project folder (no __init__.py) in the current directory is imported first, as an empty namespace
    package: the load error says so and where, not only "module has no attribute" (two outside users)."""
    import subprocess
    import sys
    (tmp_path / "shadowed_attn" / "shadowed_attn").mkdir(parents=True)
    (tmp_path / "shadowed_attn" / "shadowed_attn" / "__init__.py").write_text("Backend = None\n")
    out = subprocess.run([sys.executable, "-m", "mha_harness", "check", "--backend-spec", "shadowed_attn:Backend",
                          "--results", str(tmp_path / "results")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "has no attribute 'Backend'" in text and "imported as a namespace package" in text, text[-2000:]
    assert str(tmp_path / "shadowed_attn") in text


def test_two_backends_with_one_name_is_an_error_naming_both_sources():
    with pytest.raises(RegistryError) as info:
        load_registry(["tests.plugin_objects:DuplicateOfNaive"], entry_points=False)
    message = str(info.value)
    assert "numpy-naive" in message and "mha_harness.implementations.numpy_naive:NumpyNaive" in message
    assert "tests.plugin_objects:DuplicateOfNaive" in message


def test_check_accepts_an_object_defined_in_a_test_file():
    """The lesson's plain function passes everything it declares except NaN/inf poisoning of masked future
    keys: its dense weights @ V computes 0 * NaN = NaN, a real finding the suite must report."""
    from tests.plugin_objects import LessonFunction
    report = mha_harness.check(LessonFunction, include_slow=False)
    failures = report.failures()
    assert {(r.case, r.params["poison"]) for r in failures} == {("check_causal_mask_blocks_future_keys", "nan"),
                                                                ("check_causal_mask_blocks_future_keys", "inf")}
    skipped = {r.case: r.message for r in report.results if r.status == "skipped"}
    assert "key_padding_mask" in skipped["check_padding_mask_blocks_padded_keys"]
    assert report.counts()["passed"] >= 25


def test_opt_in_backends_run_only_when_named_or_with_opt_in(capsys):
    """The compiled backends (minutes of compilation) are left out of a run that names no backend, said so with
    the reason; --opt-in or --backend NAME runs them."""
    import argparse

    from mha_harness.cli import _targets
    from mha_harness.registry import load_registry, opt_in_reason
    registry = load_registry()
    opted = {e.name for e in registry.opted_out()}
    compiled = {n for n in ("torch-flex-cpu", "torch-compile-cpu")
                if n in registry.entries and registry.get(n).available}
    assert opted == compiled and all(opt_in_reason(registry.get(n)) for n in opted)
    default = _targets(argparse.Namespace(backend=[], backend_spec=[], opt_in=False), registry)
    assert not opted & set(default) and "numpy-naive" in default
    printed = capsys.readouterr().out
    assert all(f"not run unless named: {n}" in printed for n in opted)
    assert opted <= set(_targets(argparse.Namespace(backend=[], backend_spec=[], opt_in=True), registry))
    for name in opted:
        assert _targets(argparse.Namespace(backend=[name], backend_spec=[], opt_in=False), registry) == [name]
