"""The device axis of the tests that run on both sides: the CPU variant (reference) and the GPU variant (kernel).

A test parametrized over ``DEVICES`` runs its whole input construction and checks on the CPU against the
reference, and on CUDA (marked ``gpu``) calls the kernels through ``backend="kernel"``, so a silent fall-back to the
reference cannot pass there."""

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
on_devices = pytest.mark.parametrize("device", DEVICES)


def backend_for(device: str) -> str:
    """"reference" on the CPU; on CUDA "kernel" (the test skips where TileLang or a Hopper GPU is missing)."""
    if device == "cpu":
        return "reference"
    pytest.importorskip("tilelang")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernels target Hopper (sm_90a)")
    return "kernel"
