"""Which packages the wheel holds (the metadata is in pyproject.toml).

conf/, the Hydra config tree at the repository's top, is the package dtf.conf: edited there,
installed as dtf/conf/ by a regular install and mapped to conf/ by an editable one, so
`python -m dtf` finds the same tree in a checkout and in an installed wheel.
recipes/, the seed scenarios as configs with their measured results, is the package dtf.recipes
in the same way: its YAML files are the config group `recipe` (dtf.config.store).
hydra_plugins: Hydra loads sweepers only from that namespace (hydra/sweeper=dtf lives there).
"""

from setuptools import find_namespace_packages, setup

# Namespace-style discovery, as pyproject's packages.find does: hydra_plugins has no __init__.py.
found = find_namespace_packages(include=["dtf", "dtf.*", "hydra_plugins", "hydra_plugins.*"], exclude=["*.__pycache__"])

setup(
    packages=[*found, "dtf.conf", "dtf.recipes"],
    package_dir={"dtf.conf": "conf", "dtf.recipes": "recipes"},
)
