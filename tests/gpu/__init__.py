# A package, so that this folder's conftest.py is imported as gpu.conftest: two plain "conftest" modules would
# replace each other in sys.modules, and tests/*.py import helpers with `from conftest import ...`.
