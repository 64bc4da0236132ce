"""What a run recorded, read back. Read in this order:

    tracing.py          --trace: clocks aligned over the ranks, events gathered, the file written
    traceview.py        a trace file read back: spans, messages, the schedule each rank ran
    draw.py             ASCII Gantt charts and SVG timelines
"""
