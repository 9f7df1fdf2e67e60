"""The optional C extensions; everything else about the package is in pyproject.toml.

Without a C compiler the package installs all the same, and does the same work in numpy or one
library call per item: compressed frames are checked and decoded one call per frame
(`diskreplay.format.lz4_blocks`), uniform draws are numpy's (`diskreplay.sampling.draws`), episode
bounds and stack windows are numpy searches (`diskreplay.episodes.index`)."""

from setuptools import Extension, setup

EXTENSIONS = ("diskreplay.format._batch", "diskreplay.sampling._draws", "diskreplay.episodes._search")

setup(ext_modules=[Extension(name, [name.replace(".", "/") + ".c"], optional=True) for name in EXTENSIONS])
