"""See a schedule: each stage's list, minipar's simulator's verdict and the Gantt chart, the
student's beside minipar's. The student's own tool: it loads the student's file in this
process (the grader never does; lab.py judges what a sandboxed child recorded).

    .venv/bin/python -m labs.07_schedules.show 1f1b 3 4 --student labs/07_schedules/student.py
    .venv/bin/python -m labs.07_schedules.show gpipe 4 8 --student my_schedules.py --backward-time 2
"""
import argparse
import os
import re

from labs import framework
from minipar.show import draw
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.schedules import ScheduleError

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"gpipe": "gpipe", "1f1b": "one_f_one_b"}      # --schedule name -> the student's function


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m labs.07_schedules.show",
                                 description="Print each stage's list of a schedule, the simulator's verdict "
                                             "and the Gantt chart, beside minipar's.")
    ap.add_argument("schedule", choices=tuple(NAMES))
    ap.add_argument("n_stages", type=int)
    ap.add_argument("n_micro", type=int)
    ap.add_argument("--student", metavar="PATH", default=os.path.join(HERE, "student.py"),
                    help="the file [labs/07_schedules/student.py]")
    ap.add_argument("--backward-time", type=float, default=1.0, help="a backward's length, a forward's is 1 [1]")
    args = ap.parse_args(argv)
    p, m, name = args.n_stages, args.n_micro, args.schedule
    if p < 1 or m < 1:
        ap.error("n_stages and n_micro must be at least 1")
    fn = getattr(framework.load(os.path.abspath(args.student), "student"), NAMES[name])
    stuck = {}
    try:
        report = schedules.check(p, m, fn, backward_time=args.backward_time)
        verdict = report.summary()
    except ScheduleError as e:
        report, verdict = None, f"ScheduleError: {e}"
        stuck = {int(s): int(k) for s, k in re.findall(r"stage (\d+),? (?:at )?instruction (\d+)", str(e))}
    print(f"{fn.__name__}, p={p} stages, m={m} micro-batches (>> marks where a stage is stuck):")
    for s in range(p):
        prog = list(fn(s, p, m))
        print(f"  stage {s}: " + " ".join((">>" if stuck.get(s) == k else "") + str(ins) for k, ins in enumerate(prog)))
    print(verdict)
    if report is not None:
        print(draw.ascii_gantt(report.timeline, p))
    ref = schedules.check(p, m, name, backward_time=args.backward_time)
    print(f"minipar's {name}: {ref.summary()}")
    print(draw.ascii_gantt(ref.timeline, p))


if __name__ == "__main__":
    main()
