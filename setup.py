"""The wheel ships the product only; pyproject.toml holds the rest of the configuration.

pyproject's `packages` is what an editable install maps (setuptools' editable finder maps the folders of the listed
packages, from the distribution's list), so it names envex.tests: the tests and the lab import envex.tests.support
from a checkout. envex.verify.lab, the lab, comes with verify/. Every file list build_py makes (the wheel's, the
sdist's) leaves SOURCE_ONLY and everything under them out. tests/test_wheel_contents.py builds the wheel and checks.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# Packages of a checkout that no wheel carries: the tests and their support, and the lab (device scripts, kernel
# benches, raw results).
SOURCE_ONLY = ("envex.tests", "envex.verify.lab")


def source_only(package: str) -> bool:
    return any(package == name or package.startswith(name + ".") for name in SOURCE_ONLY)


class ProductBuildPy(build_py):
    """build_py over the product packages only. The filter is not keyed on editable mode: setuptools finalizes
    build_py for the metadata before it sets that mode, and the editable finder reads the distribution's list."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.packages = [package for package in self.packages or () if not source_only(package)]

    def run(self) -> None:
        if not self.editable_mode:
            # The wheel takes all of build/lib: a build made before this filter left envex/tests there.
            for name in SOURCE_ONLY:
                shutil.rmtree(Path(self.build_lib, *name.split(".")), ignore_errors=True)
        super().run()


setup(cmdclass={"build_py": ProductBuildPy})
