"""settle_heap() in a fresh interpreter: what was alive is frozen out of the collector's
reach, the first generation is raised, and cycles made afterwards are still collected."""

import subprocess
import sys

CHECK = """
import gc, weakref
from runtime.gc_tuning import YOUNG_THRESHOLD, settle_heap
before = gc.get_threshold()
settle_heap()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2]), gc.get_threshold()
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None
"""


def test_settle_heap_freezes_start_up_and_still_collects_cycles():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
