"""trainer.precision, trainer.compile and trainer.activation_checkpointing are checked on the driver:
a value that cannot work is one line naming the key and the fix, before any rank starts; the FSDP
keys they replaced are refused with the new key's name."""

from __future__ import annotations

import pytest
import torch

from dtf.errors import UserError
from dtf.preflight import validate
from tests.helpers.inprocess import compose


def refusal(*overrides: str) -> str:
    with pytest.raises(UserError) as err:
        validate(compose(*overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("overrides", "start", "fix"),
    [
        (["trainer.precision=fp8"], "trainer.precision=fp8", "bf16-mixed, fp16-mixed, bf16-true"),
        (["trainer.precision=16-mixed"], "trainer.precision=16-mixed", "fp16-mixed"),
        (["trainer.compile=maybe"], "trainer.compile=maybe", "blocks"),
        (["trainer.activation_checkpointing=[]"], "trainer.activation_checkpointing=[]", "null"),
        (["trainer.activation_checkpointing=[NoSuchBlock]"], "trainer.activation_checkpointing: no module", "Linear"),
        (
            ["model=mnist_cnn", "trainer.activation_checkpointing=[MnistCNN]"],  # the root is no block
            "trainer.activation_checkpointing: no module of class MnistCNN",
            "Conv2d",
        ),
        (["strategy=fsdp", "strategy.param_dtype=bf16"], "strategy.param_dtype=bf16", "trainer.precision=bf16-mixed"),
        (["strategy=fsdp", "strategy.param_dtype=fp16"], "strategy.param_dtype=fp16", "trainer.precision=fp16-mixed"),
        (["strategy=mics", "strategy.reduce_dtype=fp32"], "strategy.reduce_dtype=fp32", "trainer.precision"),
        (
            ["strategy=fsdp", "strategy.activation_checkpointing=true"],
            "strategy.activation_checkpointing=true",
            "trainer.activation_checkpointing=[",
        ),
        (
            ["model._target_=torch.nn.Linear", "~model.hidden", "trainer.compile=blocks"],  # a model of one layer
            "trainer.compile=blocks",
            "trainer.compile=true",
        ),
    ],
)
def test_a_switch_that_cannot_work_is_one_line_naming_the_key_and_the_fix(
    overrides: list[str], start: str, fix: str
) -> None:
    message = refusal(*overrides)
    assert message.startswith(start) and fix in message, message


def test_switches_that_work_pass() -> None:
    validate(
        compose("trainer.precision=bf16-mixed", "trainer.compile=blocks", "trainer.activation_checkpointing=[Linear]")
    )
    validate(compose("strategy=fsdp", "strategy.activation_checkpointing=false", "trainer.precision=32"))
    validate(compose("model=mnist_cnn", "strategy=fsdp", "trainer.activation_checkpointing=[Conv2d,Linear]"))


def test_compile_without_a_cpp_compiler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # inductor builds its CPU kernels with $CXX
    message = refusal("trainer.compile=true")
    assert message.startswith("trainer.compile=true needs a C++ compiler") and "trainer.compile=false" in message
    validate(compose("trainer.compile=false"))  # eager needs none


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # read, not run, here: no GPU on this machine, so CUDA is faked for the driver's checks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    message = refusal("trainer.precision=bf16-mixed")
    assert message.startswith("trainer.precision=bf16-mixed") and "fp16-mixed" in message
    validate(compose("trainer.precision=bf16-mixed", "trainer.device=cpu"))  # bf16 autocast works on any CPU
