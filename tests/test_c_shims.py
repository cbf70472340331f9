"""aoti engines call the kiln_cpp ops through their C shims (kiln/plugins/c_shims.py,
csrc/c_shim.h), not through AOTInductor's proxy executor."""
import json
import shutil
import zipfile

import pytest
import torch

from kiln.config import ConfigError

pytest.importorskip("kiln.plugins.cpp").load()


class Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64))

    def forward(self, x):
        y, residual = torch.ops.kiln_cpp.fused_add_rms_norm(x, x, self.weight, 1e-6)
        return torch.ops.kiln_cpp.rms_norm(y + residual, self.weight, 1e-6)


def generated_code(package) -> str:
    with zipfile.ZipFile(package) as z:
        return next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))


@pytest.fixture(scope="module")
def norms_package(tmp_path_factory):
    from kiln.build.backends import compile_aoti

    model = Norms().eval()
    program = torch.export.export(model, (torch.randn(3, 64),),
                                  dynamic_shapes={"x": {0: torch.export.Dim("tokens", min=1, max=64)}})
    path = tmp_path_factory.mktemp("shims") / "norms.engine"
    return model, path, compile_aoti(program, path, max_autotune=False)


def test_package_calls_the_ops_through_their_shims(norms_package):
    model, path, shims = norms_package
    assert [s.split("(")[0] for s in shims] == ["AOTITorchError aoti_torch_cpu_fused_add_rms_norm",
                                               "AOTITorchError aoti_torch_cpu_rms_norm"]
    code = generated_code(path)
    assert "proxy_executor_call_function" not in code
    assert "aoti_torch_cpu_fused_add_rms_norm(" in code and "aoti_torch_cpu_rms_norm(" in code

    unpacked = path.parent / "unpacked"  # not under /tmp/aotinductor_*, where test_extraction looks
    with zipfile.ZipFile(path) as z:
        z.extractall(unpacked)
    loader = torch._C._aoti.AOTIModelPackageLoader(str(unpacked), "model", False, 1, -1)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(loader.boxed_run([x])[0], model(x), rtol=0, atol=0)
    # A kernel's check reaches the caller with its message.
    with pytest.raises(RuntimeError, match=r"kiln_cpp::fused_add_rms_norm: weight must be .* \(32\)"):
        loader.boxed_run([torch.randn(5, 32)])


def test_switch(monkeypatch, norms_package):
    from kiln.plugins import c_shims

    model = Norms().eval()
    program = torch.export.export(model, (torch.randn(3, 64),))
    assert [op._opname for op in c_shims.for_program(program)] == ["fused_add_rms_norm", "rms_norm"]
    monkeypatch.setenv("KILN_C_SHIMS", "0")
    assert c_shims.for_program(program) == {}
    monkeypatch.setenv("KILN_C_SHIMS", "yes")
    with pytest.raises(ValueError, match="KILN_C_SHIMS must be 0 or 1"):
        c_shims.for_program(program)


def test_engine_built_against_other_shims_is_refused(engine, tmp_path):
    from kiln.engine.loader import load
    from kiln.plugins import c_shims

    built = engine("llama", "aoti")
    shims = json.loads((built / "config.json").read_text())["build_config"]["c_shims"]
    assert shims and set(shims) <= set(c_shims.declarations().values())
    assert "proxy_executor_call_function" not in generated_code(built / "rank0.engine")

    changed = tmp_path / "e"
    shutil.copytree(built, changed)
    config = json.loads((changed / "config.json").read_text())
    config["build_config"]["c_shims"][0] = shims[0].replace("(", "(int64_t since_changed, ", 1)
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no longer declare alike .*rebuild the engine"):
        load("aoti", changed / "rank0.engine")
