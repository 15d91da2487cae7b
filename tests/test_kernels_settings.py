import pytest
import torch

from components.engine import kernels


def test_parse_and_configure_round_trip():
    previous = kernels.configure("attention=flex, moe=fused")
    try:
        s = kernels.settings()
        assert (s.attention, s.moe, s.decode_graphs) == ("flex", "fused", previous.decode_graphs)
        assert kernels.enabled("attention", torch.zeros(1), "flex")  # forced on, even on CPU
        kernels.configure("plain")
        assert not kernels.enabled("attention", torch.zeros(1), "flex")
        assert kernels.settings().moe == "grouped"  # falls back to the loop where grouped GEMMs do not run
    finally:
        kernels.configure(previous)
    assert kernels.settings() == previous


def test_auto_is_plain_on_cpu():
    assert not kernels.fast_device(torch.zeros(1, dtype=torch.bfloat16))
    assert not kernels.enabled("compile", torch.zeros(1), "on") or kernels.settings().compile == "on"


@pytest.mark.parametrize("spec", ["attention=magic", "speed=fast", "moe"])
def test_bad_settings_name_the_choices(spec):
    with pytest.raises(ValueError, match="use one of"):
        kernels.parse(spec)
