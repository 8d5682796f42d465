"""The built-in scenarios learn for real, and a user's several-module model trains by its own step."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def test_mnist_cnn_reaches_97_percent_on_the_real_digits_with_the_experiments_defaults(dtf) -> None:  # type: ignore[no-untyped-def]
    # Horovod's MNIST example's recipe on 2 ranks, as a user runs it: python -m dtf +experiment=digits_cnn
    run = dtf("+experiment=digits_cnn", "checkpoint.every_n_steps=null")
    assert run.returncode == 0, run.stderr[-3000:]
    s = run.summary
    assert s["world_size"] == 2 and s["objective_name"] == "test/accuracy" and s["objective_mode"] == "max"
    assert s["objective"] == s["final_metrics"]["test/accuracy"] >= 0.97, s["final_metrics"]  # chance: 0.10


def test_fake_images_throughput_run(dtf) -> None:  # type: ignore[no-untyped-def]
    run = dtf(
        "model=mnist_cnn",
        "data=fake_images",
        "loss=nll",
        "metrics=accuracy",
        "data.dataset.num_samples=512",
        "data.dataset.num_test=64",
        "trainer.max_epochs=1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary["global_step"] == 4 and run.summary["samples_per_sec"] > 0


def test_several_modules_with_a_user_step_function(dtf) -> None:  # type: ignore[no-untyped-def]
    run = dtf(
        f"hydra.searchpath=[file://{HELPERS / 'user_conf'}]",
        "model=two_tower",
        "+trainer.step_fn._target_=user_models.encoder_head_step",
        "+trainer.step_fn._partial_=true",
        "trainer.max_epochs=3",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    s = run.summary
    assert s["params_sha256_consistent"]
    assert s["final_test_loss"] < 0.5  # z = sin(y) + cos(x) has variance ~1; a trained net is far below
