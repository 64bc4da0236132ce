"""What a run is asked to do, checked before anything runs. Read in this order:

    flags.py            the trainer's flags, their defaults and their checks (ConfigError:
                        one line naming the values)
    outputs.py          the files a run may write, checked against its inputs and against
                        what they would replace
"""
