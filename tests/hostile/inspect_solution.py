# hostile: reads the hand solution through inspect
# lab: 02
# scan: import of inspect
# sandbox: the file defines no reduce_scatter
import inspect
import sys

for name, module in list(sys.modules.items()):
    if name.startswith("labs"):
        try:
            src = inspect.getsource(module)
        except (OSError, TypeError):
            continue
