"""Maps the three source folders onto one import name, ``servelab``.

The package list is computed from the folders, so a new sub-folder can never
be silently left out of the wheel. A ``csrc`` folder holds C++ sources, built
on the user's machine: it ships its headers and sources (setuptools treats every
folder as a package, so it is one, with no Python in it).
"""

import os

from setuptools import setup

ROOTS = {"servelab": "core", "servelab.plugins": "plugins", "servelab.conf": "conf"}
SOURCE_FOLDER = "csrc"


def find_packages_under(prefix: str, folder: str) -> dict[str, str]:
    found = {}
    for dirpath, dirnames, _ in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        rel = os.path.relpath(dirpath, folder)
        name = prefix if rel == "." else prefix + "." + rel.replace(os.sep, ".")
        found[name] = dirpath
    return found


package_dir: dict[str, str] = {}
for prefix, folder in ROOTS.items():
    package_dir.update(find_packages_under(prefix, folder))

package_data = {name: ["*.yaml"] for name in package_dir if name.startswith("servelab.conf")}
for name in package_dir:
    if name.rsplit(".", 1)[-1] == SOURCE_FOLDER:
        package_data[name] = ["*.h", "*.cpp"]

setup(
    package_dir=package_dir,
    packages=sorted(package_dir),
    package_data=package_data,
    include_package_data=True,
)
