"""Package layout only (metadata lives in pyproject.toml).

The repository folder ``cli/`` installs as the package ``ckpt_cli``: a top-level ``cli``
package would shadow (or be shadowed by) any user project with a ``cli/`` folder, and
``python -m cli`` ran the user's. pyproject.toml cannot combine package discovery with a
renamed folder, hence this file.
"""

from setuptools import find_packages, setup

LIBS = find_packages(include=["ckpt", "ckpt.*", "replay", "replay.*", "runs", "runs.*"])
CLI = ["ckpt_cli" + name[len("cli"):] for name in find_packages(include=["cli", "cli.*"])]

setup(packages=LIBS + CLI, package_dir={"ckpt_cli": "cli"})
