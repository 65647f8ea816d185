"""Triton python model `ensemble`: tensorrtllm_backend's ensemble interface, relayed to `tensorrt_llm_bls`.

Copied into triton_repo/<name>/ensemble/1/model.py. Triton 2.51's own ensemble (platform
"ensemble") never tells its steps that the client cancelled, hit its deadline or disconnected, so a
request abandoned on it decoded to its last token. This model forwards each request to the model
that decodes (a BLS call with the same inputs and an id of its own), relays its responses, and
watches its own client: once the client is gone it sends that model a `stop` request naming the
id, tensorrtllm_backend's way to cancel, and the row stops at its next step. A client's own `stop`
request (request id = the id it gave the request to cancel) is forwarded the same way. It holds no
weights and imports nothing from the project. Decoupled (streaming) or not follows its config.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WATCH_S = 0.05  # how often the watcher wakes
CHECK_S = 0.1  # how often the client of a request that is decoding (has had a response) is asked if it is there
QUEUED_CHECK_S = 1.0  # ... and of one still queued: each ask is a round trip to Triton, and at 128 requests in
# flight asking all of them every 100 ms took most of a core


class _Flight:
    """One relayed request. `lock` orders the final send against the watcher's `is_cancelled`: Triton frees a
    request's response factory with its final response, and asking it afterwards crashes the server."""

    def __init__(self, sender, client_id: str):
        self.sender, self.client_id = sender, client_id
        self.checked = 0.0
        self.started = False  # a response came: the request is decoding, not queued
        self.relayed = False  # handed to the decoding model (else it waits for a slot here)
        self.stopped: bool | str = False
        self.final = False
        self.lock = threading.Lock()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = json.loads(args["model_config"])
        params = cfg.get("parameters", {})
        self.target = params.get("target_model", {}).get("string_value", "tensorrt_llm_bls")
        self.target_decoupled = params.get("target_decoupled", {}).get("string_value", "true") == "true"
        self.inputs = [i["name"] for i in cfg["input"]]
        self.outputs = [o["name"] for o in cfg["output"]]
        self.flights: dict[str, _Flight] = {}
        self.lock = threading.Lock()
        # At most this many relayed requests are handed to the decoding model at once (it runs max_batch_size
        # rows and queues the rest); the others wait here. With 64 BLS calls pending, Triton 2.51's stub stopped
        # answering the watcher's is_cancelled(), so abandoned requests decoded on; 16 pending are fine.
        self.slots = threading.Semaphore(max(2, 2 * int(cfg.get("max_batch_size", 1) or 1)))
        family = pb_utils.MetricFamily(name="spec_decode_relay_cancelled_total", kind=pb_utils.MetricFamily.COUNTER,
                                       description="Requests cancelled while queued in the ensemble relay (never "
                                                   "decoded; the decoding model counts the others)")
        self.relay_cancelled = family.Metric(labels={"model": args.get("model_name", "ensemble")})
        self.stopping = False
        self.watcher = threading.Thread(target=self._watch, name="cancel-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            client_id = request.request_id()
            stop = pb_utils.get_input_tensor_by_name(request, "stop")
            if stop is not None and stop.as_numpy().size and bool(stop.as_numpy().reshape(-1)[0]):
                self._client_stop(sender, client_id)
                continue
            threading.Thread(target=self._relay, args=(request, sender, client_id), daemon=True).start()
        return None

    def _client_stop(self, sender, client_id: str) -> None:
        if not client_id:
            err = pb_utils.TritonError("stop: true needs the request_id of the request to stop; send it as this "
                                       "request's id (the id you gave the request to cancel)")
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=FINAL)
            return
        with self.lock:
            ids = [i for i, f in self.flights.items() if f.client_id == client_id]
        for i in ids or [client_id]:  # none in flight here: it may be queued under the client's own id
            self._stop(i)
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)

    def _stop(self, internal_id: str) -> None:
        """Ask the decoding model to stop the request it knows as `internal_id`."""
        req = pb_utils.InferenceRequest(model_name=self.target, request_id=internal_id,
                                        inputs=[pb_utils.Tensor("stop", np.array([[True]], dtype=bool))],
                                        requested_output_names=["text_output"])
        try:
            if self.target_decoupled:
                for _ in req.exec(decoupled=True):
                    pass
            else:
                req.exec()
        except Exception as e:  # noqa: BLE001
            pb_utils.Logger.log_warn(f"ensemble: could not stop {internal_id}: {type(e).__name__}: {e}")

    def _relay(self, request, sender, client_id: str) -> None:
        internal = f"{client_id}#{uuid.uuid4().hex[:12]}" if client_id else f"ensemble#{uuid.uuid4().hex[:12]}"
        tensors = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in self.inputs) if t is not None]
        stream_t = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = stream_t is not None and bool(stream_t.as_numpy().reshape(-1)[0])
        flight = _Flight(sender, client_id)
        with self.lock:
            self.flights[internal] = flight
        answered = False
        while not self.slots.acquire(timeout=WATCH_S):
            if flight.stopped:  # the client left while queued here: nothing was decoded
                self.relay_cancelled.increment(1.0)
                self._send(flight, pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    "request cancelled by the client", pb_utils.TritonError.CANCELLED)), FINAL)
                with self.lock:
                    self.flights.pop(internal, None)
                return
        flight.relayed = True
        try:
            bls = pb_utils.InferenceRequest(model_name=self.target, inputs=tensors, request_id=internal,
                                            requested_output_names=self.outputs, parameters={"relay": True})
            responses = bls.exec(decoupled=True) if self.target_decoupled else [bls.exec()]
            for resp in responses:
                flight.started = True
                if answered:
                    continue
                if resp.has_error():
                    answered = self._send(flight, pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(resp.error().message())), FINAL)
                    continue
                out = resp.output_tensors()
                if not out:
                    continue  # the empty final response of a decoupled stream
                err = next((t for t in out if t.name() == "error_message"), None)
                if err is not None:  # the decoding model's error, in band (see model.py TritonResponder.error)
                    msg = err.as_numpy().reshape(-1)[0]
                    msg = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
                    code = pb_utils.TritonError.CANCELLED if msg.startswith("CANCELLED: ") else None
                    msg = msg.removeprefix("CANCELLED: ")
                    error = pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)
                    answered = self._send(flight, pb_utils.InferenceResponse(output_tensors=[], error=error), FINAL)
                    continue
                if stream:
                    if not self._send(flight, pb_utils.InferenceResponse(output_tensors=out), 0):
                        answered = True
                else:
                    answered = self._send(flight, pb_utils.InferenceResponse(output_tensors=out), FINAL)
            if not answered:
                self._send(flight, None, FINAL)
        except Exception as e:  # noqa: BLE001 - answer the client, keep serving
            pb_utils.Logger.log_error(f"ensemble: relaying {internal} failed: {type(e).__name__}: {e}")
            if not answered:
                self._send(flight, pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"ensemble: {type(e).__name__}: {e}")), FINAL)
        finally:
            self.slots.release()
            with self.lock:
                self.flights.pop(internal, None)

    def _send(self, flight: _Flight, response, flags: int) -> bool:
        """Send to the client; False (and the request marked for stopping) when the client is gone."""
        try:
            with flight.lock:
                if flight.final:
                    return False
                flight.final = bool(flags & FINAL)
                if response is None:
                    flight.sender.send(flags=flags)
                else:
                    flight.sender.send(response, flags=flags)
            return True
        except Exception as e:  # noqa: BLE001 - the client went away: the watcher stops the decoding
            pb_utils.Logger.log_verbose(f"ensemble: client gone ({type(e).__name__}: {e})")
            flight.checked = 0.0
            flight.stopped = flight.stopped or "gone"
            return False

    def _watch(self) -> None:
        while not self.stopping:
            time.sleep(WATCH_S)
            now = time.monotonic()
            with self.lock:
                due = [(i, f) for i, f in self.flights.items() if f.stopped is not True
                       and now - f.checked >= (CHECK_S if f.started or f.stopped == "gone" else QUEUED_CHECK_S)]
            for internal, f in due:
                f.checked = now
                try:
                    with f.lock:
                        if f.final:
                            continue
                        gone = f.stopped == "gone" or bool(f.sender.is_cancelled())
                except Exception as e:  # noqa: BLE001 - cannot ask Triton: treat the client as gone
                    pb_utils.Logger.log_warn(f"ensemble: cancellation check for {internal} failed: {e}")
                    gone = True
                if gone:  # stop without waiting: the answer comes at the decoder's next step, and waiting for each
                    f.stopped = True  # in turn let 64 abandoned requests decode on for 64 steps
                    if f.relayed:
                        threading.Thread(target=self._stop, args=(internal,), daemon=True).start()

    def finalize(self) -> None:
        self.stopping = True
        self.watcher.join(timeout=5)
