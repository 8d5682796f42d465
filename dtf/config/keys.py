"""The keys a run's config may have at its top, and the nearest real key for one it may not.

A key dtf does not read must not pass silently (`+ckpt_path=...` would train from scratch and say
nothing). Users coming from Lightning, lightning-hydra-template, torchtitan or Composer bring their
names along: the common ones map to dtf's; any other gets the nearest section by spelling; values
of the user's own (used through interpolation) belong under `extra`.
"""

from __future__ import annotations

import difflib
import re

# The sections of dtf's config tree (conf/config.yaml's groups), and what others add: `trial` (a
# trial of hydra/sweeper=dtf), `extra` (free-form values of the user's own).
SECTIONS = (
    "model",
    "data",
    "optimizer",
    "scheduler",
    "loss",
    "metrics",
    "strategy",
    "launcher",
    "trainer",
    "checkpoint",
    "logger",
    "trial",
    "extra",
)

# Names other training tools use (Lightning, lightning-hydra-template, torchtitan, Composer), and
# what dtf has instead.
FOREIGN = {
    "ckpt_path": "a run resumes from checkpoint.resume (auto: the run dir's newest checkpoint, or a path)",
    "resume": "a run resumes from checkpoint.resume (auto: the run dir's newest checkpoint, or a path)",
    "resume_from_checkpoint": "a run resumes from checkpoint.resume (auto: the run dir's newest checkpoint, or a path)",
    "checkpoint_path": "a run resumes from checkpoint.resume (auto: the run dir's newest checkpoint, or a path)",
    "loggers": "choose loggers with the logger group: logger=[tensorboard,mlflow,csv]",
    "callbacks": "early stopping, checkpoints and logging are settings of trainer and checkpoint",
    "seed": "use trainer.seed",
    "lr": "use optimizer.lr",
    "learning_rate": "use optimizer.lr",
    "batch_size": "use data.batch_size (per rank)",
    "epochs": "use trainer.max_epochs",
    "max_epochs": "use trainer.max_epochs",
    "max_steps": "use trainer.max_steps",
    "precision": "use trainer.precision",
    "devices": "use launcher.nproc (ranks per node)",
    "gpus": "use launcher.nproc (ranks per node)",
    "num_nodes": "use launcher.nnodes",
    "datamodule": "data is the group of data options (data=<option>)",
    "dataset": "use data.dataset",
    "net": "model is the group of models (model=<option>)",
    "objective": "use trainer.objective",
    "optimized_metric": "use trainer.objective",
    "test": "the test split is data's (data.test_path, or the dataset's second split)",
}


# Lightning Trainer's arguments (lightning-hydra-template's trainer/*.yaml sets them), under dtf's
# trainer section, and what dtf has instead.
FOREIGN_TRAINER = {
    "fast_dev_run": "use debug=fast: two steps and two batches of each evaluated split, nothing kept",
    "val_check_interval": "use trainer.eval_every_n_epochs, a fraction of an epoch too, or trainer.eval_every_n_steps",
    "check_val_every_n_epoch": "use trainer.eval_every_n_epochs",
    "devices": "use launcher.nproc, the ranks per node",
    "gpus": "use launcher.nproc, the ranks per node",
    "num_nodes": "use launcher.nnodes",
    "accelerator": "use trainer.device: auto, cpu or cuda",
    "strategy": "strategy is the group of strategies: strategy=ddp|zero|fsdp|mics",
    "accumulate_grad_batches": "use trainer.grad_accum_steps",
    "gradient_clip_val": "use trainer.grad_clip_norm",
    "limit_val_batches": "use trainer.limit_eval_batches",
    "limit_test_batches": "use trainer.limit_eval_batches",
    "max_time": "dtf has no time limit: bound the run with trainer.max_steps or trainer.max_epochs; a scheduler's "
    "time limit stops it at a checkpoint through checkpoint.stop_signals",
    "min_epochs": "dtf trains to trainer.max_epochs, or until trainer.early_stopping stops it",
    "min_steps": "dtf trains to trainer.max_steps, or until trainer.early_stopping stops it",
    "num_sanity_val_steps": "dtf runs no sanity evaluation before training: debug=fast checks a config in seconds",
    "default_root_dir": "the run directory is hydra.run.dir, hydra.sweep.dir for a sweep",
    "enable_progress_bar": "use trainer.progress: auto, bar, lines or off",
    "enable_checkpointing": "checkpoints follow checkpoint.every_n_steps and checkpoint.every_n_epochs",
    "detect_anomaly": "non-finite losses and gradients are caught by trainer.on_nonfinite",
}


def section_key_hint(section: str, name: str, fields: set[str]) -> str:
    """What a key dtf does not know inside one of its sections should be instead: its Lightning
    equivalent, else the nearest key by spelling, else the section's keys."""
    if section == "trainer" and name in FOREIGN_TRAINER:
        return FOREIGN_TRAINER[name]
    close = difflib.get_close_matches(name, sorted(fields), n=1)
    return f"did you mean {section}.{close[0]}?" if close else f"its keys: {', '.join(sorted(fields))}"


def nearest(key: str, known: list[str] | tuple[str, ...] = SECTIONS) -> str:
    """What a key dtf does not know at the top of the config should be instead, as a hint."""
    head = key.split(".")[0]
    if head in FOREIGN:
        return FOREIGN[head]
    close = difflib.get_close_matches(head, list(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    return f"a value of your own goes under extra (+extra.{head}=..., used as ${{extra.{head}}})"


def unknown_top_level_line(key: str) -> str:
    """One line for a top-level key no dtf section declares."""
    return f"{key} is not a setting of dtf: {nearest(key)}"


_COULD_NOT_OVERRIDE = re.compile(r"Could not override '([^']+)'")
# Hydra's words when the key is a config group that the defaults list does not select.
_APPEND_TO_DEFAULTS = re.compile(r"No match in the defaults list\.\s*To append to your default list use (\S+)")


def override_hint(message: str) -> str | None:
    """dtf's line for Hydra's "Could not override 'key'" (a key not in the config): the nearest real
    key, where Hydra itself would suggest adding it with `+`, which would then be ignored or refused."""
    found = _COULD_NOT_OVERRIDE.search(message)
    if found is None:
        return None
    key = found.group(1)
    group = _APPEND_TO_DEFAULTS.search(message)
    if group is not None:  # experiment=x, debug=fast without the + that adds a group: Hydra's advice stands
        return f"{key} is a config group the defaults do not choose from: add one of its options with {group.group(1)}"
    if "." not in key:
        return unknown_top_level_line(key)
    section, name = key.split(".", 1)
    fields = section_fields(section)
    if not fields or "." in name:
        return None
    return f"{key} is not a setting of dtf's {section} ({section_key_hint(section, name, fields)})"


def section_fields(section: str) -> set[str]:
    """The keys of one of dtf's schema'd sections, over all its options (every strategy's, ...)."""
    from dataclasses import fields

    from dtf.config import schema, typed

    by_section: dict[str, list[type]] = {
        "trainer": [schema.TrainerConfig],
        "checkpoint": [schema.CheckpointConfig],
        "data": list(typed.DATA.values()),
        "strategy": list(typed.STRATEGIES.values()),
        "launcher": list(typed.LAUNCHERS.values()),
    }
    classes = by_section.get(section, [])
    return {f.name for cls in classes for f in fields(cls)}


def config_error_line(e: BaseException) -> str:
    """Hydra's message for a config it cannot compose (an unknown option, a key not in the
    config, a bad grammar, a value of the wrong type) on one line, without the config search path
    it lists after it; with the reason OmegaConf gave where Hydra's own message leaves it out
    ("Error merging override trainer.max_epochs=abc: Value 'abc' of type 'str' could not be
    converted to Integer")."""
    line = " ".join(str(e).split("Config search path:")[0].split())
    hint = override_hint(line)
    if hint is not None:
        return hint
    cause = e.__cause__
    if cause is not None and str(cause).strip() and str(cause).splitlines()[0] not in line:
        line = f"{line}: {str(cause).strip().splitlines()[0]}"
    return line
