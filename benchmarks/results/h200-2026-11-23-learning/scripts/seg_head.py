"""seg_dbg with auto's starting headroom set: python seg_head.py <cap> <workload> <headroom GiB> <steps>"""
import sys, runpy
import lmsrt.policy as P
head = float(sys.argv[3])
orig = P.AutoPolicy.__init__
def init(self, limit, window):
    orig(self, limit, window)
    self.headroom = int(head * 2**30)
P.AutoPolicy.__init__ = init
sys.argv = [sys.argv[0], sys.argv[1], sys.argv[2], "auto", sys.argv[4]]
runpy.run_path(".base/dbg/seg_dbg.py", run_name="__main__")
