"""``serve --data-parallel-size N`` with tensor parallelism: each replica is its own
process group, so each gets its own rendezvous port (``--master-port + i``), checked free
and clear of the HTTP ports, or refused with a message that names the port."""

from __future__ import annotations

import argparse
import socket

import pytest

from pagedllm.server.cli import serve_parser
from pagedllm.server.data_parallel import check_http_ports, replica_argv, replica_master_ports

from .conftest import free_port_run


def _args(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(list(argv))


def test_each_replica_gets_its_own_rendezvous_port():
    master = free_port_run(3)
    args = _args("--port", "8000", "--data-parallel-size", "3", "-tp", "2",
                 "--master-port", str(master), "--dtype", "float32")  # fmt: skip
    ports = replica_master_ports(args)
    assert ports == [master, master + 1, master + 2]
    argvs = [replica_argv(serve_parser(), args, 8001 + i, p) for i, p in enumerate(ports)]
    for i, argv in enumerate(argvs):
        assert argv.count("--master-port") == 1
        assert argv[argv.index("--master-port") + 1] == str(master + i)
        assert argv[argv.index("--port") + 1] == str(8001 + i)
        assert "--data-parallel-size" not in argv
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[argv.index("--dtype") + 1] == "float32"
    # the replicas' own parser reads them back
    assert [_args(*argv).master_port for argv in argvs] == ports


def test_without_master_port_every_replica_picks_its_own():
    args = _args("--data-parallel-size", "2", "-tp", "2")
    assert replica_master_ports(args) == [None, None]
    assert "--master-port" not in replica_argv(serve_parser(), args, 8001, None)


def test_a_taken_rendezvous_port_is_refused_naming_it():
    master = free_port_run(2)
    with socket.socket() as holder:
        holder.bind(("", master + 1))
        holder.listen()
        args = _args("--data-parallel-size", "2", "-tp", "2", "--master-port", str(master))
        with pytest.raises(SystemExit, match=rf"rendezvous port {master + 1} .*replica 1"):
            replica_master_ports(args)


def test_rendezvous_ports_may_not_overlap_the_http_ports():
    args = _args("--port", "9000", "--data-parallel-size", "2", "-tp", "2",
                 "--master-port", "9001")  # fmt: skip
    with pytest.raises(SystemExit, match="overlap the HTTP ports 9000-9002"):
        replica_master_ports(args)


def test_a_worker_machine_does_not_check_ports_it_does_not_listen_on():
    master = free_port_run(2)
    with socket.socket() as holder:
        holder.bind(("", master))
        holder.listen()
        args = _args("--data-parallel-size", "2", "-tp", "2", "--nnodes", "2",
                     "--node-rank", "1", "--master-port", str(master))  # fmt: skip
        assert replica_master_ports(args) == [master, master + 1]


@pytest.mark.parametrize("taken, who", [(0, "the router's --port"), (2, "replica 1's")])
def test_a_taken_http_port_is_refused_before_any_replica_starts(taken, who):
    first = free_port_run(3)
    args = _args("--port", str(first), "--data-parallel-size", "2")
    check_http_ports(args)  # all free
    with socket.socket() as holder:
        holder.bind(("", first + taken))
        holder.listen()
        with pytest.raises(SystemExit, match=rf"port {first + taken} \({who}.*already in use"):
            check_http_ports(args)
        # a worker machine serves no HTTP
        check_http_ports(_args("--port", str(first), "--data-parallel-size", "2", "--nnodes", "2",
                               "--node-rank", "1", "-tp", "2"))  # fmt: skip


def test_the_api_key_reaches_replicas_by_environment_not_argv(monkeypatch):
    from pagedllm.server.process import API_KEY_ENV

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = _args("--data-parallel-size", "2", "--api-key", "s3cret")
    argv = replica_argv(serve_parser(), args, 8001, None)
    assert "--api-key" not in argv and "s3cret" not in argv
    assert args.api_key == "s3cret"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _args().api_key == "from-env"  # what a replica started with it reads
    assert _args("--api-key", "s3cret").api_key == "s3cret"  # the flag wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert _args().api_key is None
