from chaos.invariants import LeaderWrite, deposed_leader_commits


def test_clean_history_has_no_deposed_commits() -> None:
    assert (
        deposed_leader_commits(
            [LeaderWrite(10, 5), LeaderWrite(11, 5), LeaderWrite(20, 19), LeaderWrite(21, 19)]
        )
        == []
    )


def test_write_by_older_epoch_after_newer_is_flagged() -> None:
    hist = [LeaderWrite(10, 5), LeaderWrite(20, 19), LeaderWrite(22, 5)]
    assert deposed_leader_commits(hist) == [LeaderWrite(22, 5)]
