"""The optional C extension; everything else about the package is in pyproject.toml.

Without a C compiler the package installs all the same, and compressed frames are checked and
decoded one call per frame (`diskreplay.format.codecs`)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("diskreplay.format._batch", ["diskreplay/format/_batch.c"], optional=True)])
