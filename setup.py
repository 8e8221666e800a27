"""Which packages go where: the one packaging decision setup.cfg cannot make.

The repository's quant/ and sim/ are imported as the chapter writes them, `from quant.schemes
import ...`, by the scripts, the tests, the library itself (serve/drafting.py uses sim's cost
model) and each other. A wheel must not install them under those names (PyPI has a `quant` of
its own, and a wheel should own one top-level name), so:

- the wheel (`pip install .`) puts them in as minitransformer.quant and minitransformer.sim,
  and, in the copies of the modules it packs, spells their imports so
  (`from minitransformer.quant.schemes import ...`); nothing else in a file changes;
- an editable install (`pip install -e .`, the README's and CI's) installs them as the top-level
  quant and sim of the checkout, as they are, so that the chapter's imports work from any
  folder; nothing is copied, nothing rewritten.
"""
import os
import re
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

LIBRARY = ["minitransformer", *(f"minitransformer.{sub}" for sub in (
    "checkpoints", "drafts", "formats", "kernels", "measure", "serve"))]
CHAPTER = ["quant", "sim"]
CHAPTER_IMPORT = re.compile(r"^(\s*(?:>>> |\.\.\. )?from )(quant|sim)([.\s])", re.MULTILINE)


class build_py_in_the_wheel(build_py):
    """build_py, with quant's and sim's imports spelled where the wheel puts them."""

    def build_module(self, module, module_file, package):
        outfile, copied = super().build_module(module, module_file, package)
        if copied:
            with open(outfile, encoding="utf-8") as f:
                text = f.read()
            spelled = CHAPTER_IMPORT.sub(r"\1minitransformer.\2\3", text)
            if spelled != text:
                os.unlink(outfile)                  # a new file: a hard link stays as it was
                with open(outfile, "w", encoding="utf-8") as f:
                    f.write(spelled)
        return outfile, copied


if "editable_wheel" in sys.argv:                    # pip install -e: the checkout's names
    setup(packages=LIBRARY + CHAPTER)
else:
    setup(packages=LIBRARY + [f"minitransformer.{name}" for name in CHAPTER],
          package_dir={f"minitransformer.{name}": name for name in CHAPTER},
          cmdclass={"build_py": build_py_in_the_wheel})
