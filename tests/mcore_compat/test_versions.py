"""The megatron-core version adapter: each release-specific branch, on stand-ins for both releases (the
installed megatron-core exercises only one of them), and the declared range."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from nvfp4_train.mcore_compat import SUPPORTED_MEGATRON_CORE, check_megatron_core_version, megatron_core_version
from nvfp4_train.mcore_compat.linear import forward_impl_kwargs
from nvfp4_train.mcore_compat.optimizer import grads_for_grad_norm
from nvfp4_train.mcore_compat.transformer import no_cuda_graph_kwargs

ROOT = Path(__file__).resolve().parents[2]


def test_the_range_is_the_one_pyproject_declares_and_the_installed_release_is_in_it():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"megatron-core{SUPPORTED_MEGATRON_CORE}" in deps
    assert check_megatron_core_version() == megatron_core_version()
    for ok in ("0.16.1", "0.17.0", "0.19.2", "0.19.5"):
        assert check_megatron_core_version(ok) == ok
    for bad in ("0.16.0", "0.15.3", "0.20.0"):
        with pytest.raises(ValueError, match=rf"megatron-core {bad} is installed.*pip install"):
            check_megatron_core_version(bad)


def test_forward_impl_kwargs_drops_a_trivial_gtp_remat_size_and_refuses_sharding():
    kw016 = dict(bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=True, sequence_parallel=False,
                 grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None)
    assert forward_impl_kwargs(kw016) == kw016
    kw019 = {**kw016, "gtp_remat_size": 1}
    assert forward_impl_kwargs(kw019) == kw016
    assert "gtp_remat_size" in kw019  # the caller's dict is not changed
    with pytest.raises(ValueError, match="gtp_remat_size=2"):
        forward_impl_kwargs({**kw016, "gtp_remat_size": 2})


def test_no_cuda_graph_kwargs_names_the_field_of_each_release():
    @dataclasses.dataclass
    class Config016:  # megatron-core 0.16 / 0.17
        cuda_graph_scope: object = "full"

    @dataclasses.dataclass
    class Config018:  # megatron-core >= 0.18 (the old name kept, deprecated)
        cuda_graph_modules: object = "full"
        cuda_graph_scope: object = None

    assert no_cuda_graph_kwargs(Config016) == {"cuda_graph_scope": []}
    assert no_cuda_graph_kwargs(Config018) == {"cuda_graph_modules": []}


def test_no_cuda_graph_kwargs_builds_a_config_without_the_deprecation_warning(recwarn):
    from megatron.core.transformer import TransformerConfig

    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, **no_cuda_graph_kwargs())
    assert not [w for w in recwarn if "deprecated" in str(w.message) and "full" in str(w.message)]


def test_grads_for_grad_norm_calls_each_releases_method():
    class Opt018:
        def get_main_grads_for_grad_norm(self):
            return ["main"]

    class Opt019:
        def get_grads_for_grad_norm(self, grad_norm_group=None):
            return ["grads"] if grad_norm_group is None else []

    assert grads_for_grad_norm(Opt018()) == ["main"]
    assert grads_for_grad_norm(Opt019()) == ["grads"]
