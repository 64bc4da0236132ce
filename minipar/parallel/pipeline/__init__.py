"""Pipeline parallelism. Read in this order:

    instructions.py     a schedule's instructions: forward, backward, sends and receives
    schedules.py        naive, GPipe, 1F1B as data
    interleaved.py      interleaved 1F1B (virtual stages)
    zero_bubble.py      ZB-H1 and ZB-H2: backward split into B and W
    check.py            the deadlock checker: every schedule simulated before it runs
    stage.py            a pipeline stage of the model and the executor that walks a schedule
    summary.py          the run summary's pipeline figures and lines
"""
