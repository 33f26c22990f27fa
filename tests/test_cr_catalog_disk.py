"""The DeltaCR fidelity catalog (tests/test_cr.py) through the restore-from-disk path.

The same case functions, with two more ways of bringing a checkpoint back, both a rollback of
the sandbox on a private daemon started with `--templates 1`:

- `disk-evicted`: once the checkpoint's process dump is complete, one more full checkpoint
  evicts its templates; the rollback rebuilds them from the dump (daemon/dumps.py).
- `disk-restart`: once the dump is complete, kill -9 of the daemon and a restart (the
  templates are gone with it); the rollback rebuilds them from the dump.
- `disk-restart-fork`: the same restart, then a fork of the checkpoint (the catalog's fork
  assertions apply: the child is a new sandbox, the source keeps its own state).

Each rollback must say "restored from disk (dump of <cp>". A disk restore restores as into a
fork (the rebuilt templates are init's children): where that differs from a rollback from
templates, the case asserts it under `restore.disk` (see the cases in test_cr.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import deltabox
from deltabox import Sandbox

from conftest import OWN_PS, DaemonProc, dump_complete, new_sandbox, private_daemon
from test_cr import (  # noqa: F401  (the catalog's cases, run here with the disk fixtures)
    Restore, test_a_sleep_restored_from_an_image_sleeps_the_time_it_had_left,
    test_an_adopted_childs_alarm_comes_back,
    test_an_alarm_fires_after_a_restore_with_the_time_it_had_left,
    test_a_timeout_fires_after_a_restore_with_the_time_it_had_left,
    test_a_file_lock_comes_back_with_its_holder,
    test_descriptors_sharing_a_log_keep_one_offset,
    test_named_pipes_keep_their_unread_bytes_and_ends,
    test_a_shell_on_a_pseudo_terminal_comes_back_with_its_terminal,
    test_a_tmux_session_comes_back,
    test_a_real_pexpect_driver_and_its_shell_come_back,
    test_a_pty_shell_with_a_running_command_and_a_job_comes_back,
    test_bytes_waiting_in_a_pseudo_terminal_come_back,
    test_a_tty_session_comes_back_on_its_terminal,
    test_a_sealed_memfd_keeps_its_seals,
    test_locked_memory_comes_back_locked, test_scheduling_and_resource_limits_come_back,
    test_prctl_state_comes_back, test_parent_death_signal_and_subreaper_come_back,
    test_a_jvm_comes_back,
    test_unix_sockets_whose_peer_is_gone_come_back,
    test_a_deleted_working_directory_comes_back_deleted,
    test_a_pidfd_of_a_child_comes_back_with_its_child, test_uv_run_keeps_its_child,
    test_a_programs_big_child_is_its_child_again,
    test_a_forked_childs_memory_comes_back_page_for_page,
    test_a_stopped_process_comes_back_stopped,
    test_a_file_mapped_privately_and_written_in_place_shows_the_checkpoints_bytes,
    test_a_dev_shm_file_mapped_shared_comes_back,
    test_a_named_unix_socket_server_and_its_connection,
    test_a_socket_file_watched_by_its_server_is_not_seen_replaced,
    test_a_listener_its_workers_share_comes_back_shared,
    test_children_not_waited_for_yet_come_back_exited,
    test_flock_command_keeps_its_lock_on_the_shared_description,
    test_a_file_mapped_shared_and_writable_comes_back,
    test_a_file_mapped_shared_read_only_shows_the_checkpoints_bytes,
    test_posix_timers_come_back_with_their_ids_and_time_left,
    test_a_timer_signalling_a_thread_comes_back, test_vim_in_tmux_comes_back,
    test_a_process_of_another_user_comes_back_as_that_user,
    test_another_users_session_comes_back_with_its_children,
    test_nginx_comes_back_with_its_pid_and_workers,
    test_system_v_shared_memory_comes_back_with_its_ids,
    test_system_v_message_queues_come_back_with_their_messages,
    test_system_v_semaphore_sets_come_back_with_their_values,
    test_ipc_objects_no_process_holds_come_back_when_nothing_runs,
    test_posix_message_queues_come_back_with_their_messages,
    test_a_private_posix_queue_comes_back_with_its_holder,
    test_big_shared_memory_mostly_unwritten_comes_back, test_postgresql_comes_back,
    test_mariadb_comes_back, test_redis_comes_back_with_a_client_blocked_in_it,
    test_threads_interrupted_twice_wait_on_after_a_restore,
    test_a_tmux_pane_of_another_user_comes_back,
    test_a_session_leader_its_parent_waits_for_is_its_child_again,
    test_asyncio_server_with_eventfd_and_socket_pair, test_bash_session_state,
    test_counter_file_and_memory_agree, test_deleted_open_temp_file, test_dontfork_mapping,
    test_inotify_watches, test_listener_beside_received_descriptors,
    test_listener_without_reuseaddr_beside_its_connection, test_process_waiting_for_its_child,
    test_shell_background_job_is_its_child_again,
    test_lone_session_leader_keeps_its_pid, test_loopback_tcp_server_answers, test_main_thread_registrations,
    test_multiprocessing_pool_and_executor,
    test_nested_children_and_process_group, test_node_http_server, test_threads_come_back,
    test_pipe_flags_size_and_unread_data, test_pipeline_alive, test_python_process_memory,
    test_reader_offset, test_shared_memory, test_socket_pair_and_eventfd_between_processes,
    test_sqlite_held_open_by_a_long_lived_process, test_tcp_connection_within_the_sandbox,
    test_half_closed_tcp_connections,
    test_a_connection_its_server_accepts_during_the_checkpoint,
    test_a_datagram_its_reader_takes_during_the_checkpoint,
    test_udp_sockets_come_back_bound_connected_and_with_their_options,
    test_a_listeners_options_come_back_and_its_connections_inherit_them,
    test_netlink_sockets_and_socket_filters_come_back,
    test_socket_options_come_back_on_every_kind_of_socket,
    test_signal_driven_io_comes_back_with_its_owners_and_signals,
    test_named_datagram_sockets_come_back_with_their_clients,
    test_socket_pairs_with_an_end_shut_down_come_back_shut_down,
    test_socket_pairs_with_abstract_names_keep_them,
    test_timerfd_and_signalfd)

ARGS = ("--no-inspector", "--templates", "1")


@pytest.fixture(scope="module")
def disk_daemon() -> Iterator[DaemonProc]:
    with private_daemon("dbx-catdisk-") as d:
        d.start(*ARGS)
        yield d


@pytest.fixture
def sbx(disk_daemon: DaemonProc) -> Iterator[Sandbox]:
    if disk_daemon.proc is None or disk_daemon.proc.poll() is not None:
        disk_daemon.start(*ARGS)  # a case that failed midway through a restart
    with new_sandbox(disk_daemon.socket) as s:
        yield s


@pytest.fixture(params=["disk-evicted", "disk-restart", "disk-restart-fork"])
def restore(request, disk_daemon: DaemonProc) -> Iterator[Restore]:
    """Roll the sandbox back to the checkpoint (or, disk-restart-fork: fork a child from it
    after the restart), its processes rebuilt from their dump."""
    kids: list[Sandbox] = []

    def do(sbx: Sandbox, cp: deltabox.Checkpoint) -> Sandbox:
        dump_complete(sbx, cp.id)
        if request.param == "disk-evicted":
            # --templates 1: a newer full checkpoint evicts cp's (its dump is complete).
            sbx.checkpoint(mode="full")
        else:
            disk_daemon.kill9()
            disk_daemon.start(*ARGS)
        if request.param == "disk-restart-fork":
            kid = sbx.fork(cp)[0]
            kids.append(kid)
            assert kid.process_state == "restored", kid.fork_note
            assert f"restored from disk (dump of {cp.id})" in kid.fork_note, kid.fork_note
            return kid
        res = sbx.rollback(cp)
        assert res.process_state == "restored", res
        assert f"restored from disk (dump of {cp.id}" in res.note, res.note
        return sbx

    do.mode = request.param  # type: ignore[attr-defined]
    do.disk = True  # type: ignore[attr-defined]
    try:
        yield do
    finally:
        for k in kids:
            try:
                k.kill()
            except deltabox.DeltaBoxError:
                pass


def test_truncated_images_are_refused_with_a_clear_error(sbx: Sandbox,
                                                         disk_daemon: DaemonProc) -> None:
    """Issue 4 part 5 through the daemon: a dump whose files were cut short (a process's
    page data, its core image, the checkpoint's state.json) is refused — the rollback
    restarts the processes and names the damaged file — and restores once intact again.
    (Flipped bytes: tests/test_cr_durable.py; every image file: tests/test_cr_dump.py.)"""
    sbx.files.write("prog.py", "import os, time\nb = bytearray(os.urandom(1 << 20)) * 8\n"
                    "n = 41\nwhile True:\n    if os.path.exists('/workspace/bump'):\n"
                    "        os.remove('/workspace/bump'); n += 1\n"
                    "        open('/workspace/n', 'w').write(str(n))\n    time.sleep(0.01)\n")
    sbx.exec("nohup python3 /workspace/prog.py >/dev/null 2>&1 &")
    time.sleep(0.5)
    cp = sbx.checkpoint(mode="full")
    dump_complete(sbx, cp.id)
    sbx.checkpoint(mode="full")  # evicts cp's templates (--templates 1)
    d = disk_daemon.state_dir / "dumps" / cp.id
    img = max(d.glob("*/pages.img"), key=lambda p: p.stat().st_size).parent
    for f, cut in ((img / "pages.img", 4096), (img / "core.img", 3), (d / "state.json", 10)):
        good = f.read_bytes()
        f.write_bytes(good[:-cut])
        r = sbx.rollback(cp)
        assert r.process_state == "restarted", (f.name, r.note)
        assert f"restoring from the dump of {cp.id} failed" in r.note and f.name in r.note, \
            r.note
        live = [line for line in sbx.exec(f"{OWN_PS} args=").stdout.splitlines()
                if "prog.py" in line]
        assert live == [], live  # nothing half-restored
        f.write_bytes(good)
    r = sbx.rollback(cp)
    assert r.process_state == "restored" and f"dump of {cp.id}" in r.note, r.note
    sbx.files.write("bump", "1")
    deadline = time.monotonic() + 20
    while not (sbx.files.exists("n") and sbx.files.read("n") == b"42"):
        assert time.monotonic() < deadline, "the restored process did not answer"
        time.sleep(0.05)
