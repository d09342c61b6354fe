"""The rank's side of the controller's commands: what arrives as protobuf is
taken as plain data (:func:`trainguard.core.control.wire.command`) before the
training thread sees it; a command the rank cannot read is refused, logged
and answered, and the session goes on."""

import logging
import types

import pytest

from trainguard.core.api import ProtocolError
from trainguard.core.commands import Command, Exit, Stop
from trainguard.core.control.wire import command, command_to_pb
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.rank.processor import Processor


def test_a_command_with_no_action_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="command 7 carries no action"):
        command(pb.Command(id=7, epoch=2))


def test_the_processor_refuses_a_command_it_cannot_read_and_takes_the_next(caplog):
    p = Processor(None, rank=1)
    p.config = types.SimpleNamespace(exit_grace_s=60)  # a stand-in: next_command refuses an offline processor
    stop, leave = Command(8, 2, Stop("another rank's fault")), Command(9, 2, Exit(76, "bye"))
    p._call = [pb.ControllerMessage(command=pb.Command(id=7, epoch=2)),
               pb.ControllerMessage(command=command_to_pb(stop)), pb.ControllerMessage(command=command_to_pb(leave))]
    with caplog.at_level(logging.ERROR, "trainguard.processor"):
        p._receive()
    p._exit_timer.cancel()
    answer = p._outbox.get_nowait()
    assert answer.WhichOneof("body") == "result"
    assert (answer.result.command_id, answer.result.ok) == (7, False)
    assert "carries no action" in answer.result.message and "carries no action" in caplog.text
    assert p.stop_event.is_set() and p.stops == 1, "the STOP after it was taken"
    assert [p.next_command(timeout=0), p.next_command(timeout=0)] == [stop, leave], "plain data, in order"
