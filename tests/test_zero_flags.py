"""ZeRO-3's gather flags, ZeRO++'s and the shard group, refused with one line and exit 2 before anything
runs (in process, one rank): --prefetch and --reshard-after-forward without --zero 3, a
negative or non-whole --prefetch, --shard-group without --zero, or not dividing dp x cp.
(Across ranks and hosts: tests/test_zero_hybrid_cli.py.)"""
import pytest

from minipar.train import trainer as train
from trainer_runs import TINY, assert_main_exits_2

CASES = [
    (["--prefetch", "1"], ["--prefetch 1 is about ZeRO-3's all-gathers", "it needs --zero 3, got --zero 0"]),
    (["--zero", "2", "--prefetch", "2"], ["--prefetch 2", "needs --zero 3, got --zero 2"]),
    (["--zero", "1", "--reshard-after-forward", "off"], ["--reshard-after-forward off", "needs --zero 3"]),
    (["--zero", "3", "--prefetch", "-1"], ["--prefetch must be a whole number >= 0", "got -1"]),
    (["--shard-group", "1"], ["--shard-group 1 is how ZeRO shards", "needs --zero 1, 2 or 3"]),
    (["--zero", "1", "--shard-group", "2"], ["--shard-group 2 must be a whole number >= 1 that divides the 1"]),
    (["--zero", "1", "--shard-group", "0"], ["--shard-group 0 must be a whole number >= 1"]),
    (["--qwz", "256"], ["--qwz is ZeRO++", "needs --zero 3, got --zero 0"]),
    (["--zero", "2", "--hpz"], ["--hpz is ZeRO++", "needs --zero 3, got --zero 2"]),
    (["--zero", "1", "--qgz", "64"], ["--qgz is ZeRO++", "needs --zero 3, got --zero 1"]),
    (["--zero", "3", "--qwz", "0"], ["--qwz 0: the quantization block must be a whole number from 1 to 1048576"]),
    (["--zero", "3", "--qgz", "-4"], ["--qgz -4: the quantization block"]),
    (["--zero", "3", "--qgz", "2000000"], ["--qgz 2000000: the quantization block"]),
    (["--zero", "3", "--hpz", "--reshard-after-forward", "off"], ["--hpz keeps a host-local copy",
                                                                  "--reshard-after-forward off"]),
]
PARSER = [  # refused by the parser: its usage, then the error, exit 2
    (["--zero", "3", "--prefetch", "1.5"], "argument --prefetch: invalid int value: '1.5'"),
    (["--zero", "3", "--prefetch", "nan"], "argument --prefetch: invalid int value: 'nan'"),
    (["--zero", "3", "--reshard-after-forward", "maybe"], "argument --reshard-after-forward: invalid choice: 'maybe'"),
    (["--zero", "1", "--shard-group", "nan"], "argument --shard-group: must be a whole number of ranks or 'host', "
                                             "got 'nan'"),
    (["--zero", "1", "--shard-group", "2.0"], "must be a whole number of ranks or 'host', got '2.0'"),
]


@pytest.mark.parametrize("flags,needles", CASES, ids=[" ".join(f) for f, _ in CASES])
@pytest.mark.parametrize("dry", [False, True])
def test_bad_gather_and_shard_flags_are_one_line(capsys, fixed_peak, flags, needles, dry):
    assert_main_exits_2(TINY + flags + (["--dry-run"] if dry else []), needles, capsys, " ".join(flags))


@pytest.mark.parametrize("flags,needle", PARSER, ids=[" ".join(f) for f, _ in PARSER])
def test_values_the_parser_refuses(capsys, flags, needle):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err.strip().splitlines()[-1], err


def test_the_flag_alone_means_the_ranks_of_a_host():
    from minipar.plan import table
    for parser in (train.build_parser(), table.build_parser()):
        assert parser.parse_args(["--zero", "1", "--shard-group"]).shard_group == "host"
        assert parser.parse_args(["--zero", "1", "--shard-group", "4"]).shard_group == 4
        assert parser.parse_args(["--zero", "1"]).shard_group is None
