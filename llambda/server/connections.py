"""Connections that cannot tie the server up: a read deadline and connection caps.

    protocol = connection_protocol(read_timeout_s=30, per_client=64, total=1024, on_refused=metrics.error)
    uvicorn.Config(app, http=protocol, ...)

uvicorn times out a keep-alive connection only between requests, once a response is complete:
a client that connects and sends nothing, or sends a request's head or body a byte at a time
(slowloris), holds its connection and a file descriptor for as long as it likes. Nor does it cap
connections per client (``limit_concurrency`` counts everyone's, and answers in plain text).
This is uvicorn's own h11 protocol with both added:

- a request's head and body must arrive within ``read_timeout_s`` of its first byte (of the
  connection's opening, for the first request). Late, the client gets 408 in OpenAI's error
  shape, or a plain close when it sent nothing; a route still reading the body sees the
  disconnect. Time spent answering is not limited: generating a long reply takes what it takes;
- a request h11 cannot parse gets its 400 in OpenAI's error shape too, not uvicorn's plain text;
- a client (an IP address) may hold ``per_client`` connections at once, everyone ``total``; one
  more is answered 429 (per client) or 503 (total), with Retry-After, as soon as its first bytes
  arrive, and closed (one that sends nothing is closed at the read deadline).

The h11 protocol is named, not uvicorn's "auto": the subclass reads h11's connection states.
"""
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

RETRY_AFTER_S = 1
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 429: b"Too Many Requests", 503: b"Service Unavailable"}


def raw_response(status, message, code, type="invalid_request_error", retry_after=None):
    """A whole HTTP/1.1 response with an OpenAI error body that closes the connection: for
    answers given outside a request cycle (h11 sends a response only to a request it parsed)."""
    body = json.dumps(error_body(message, type, None, code)).encode()
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status]), b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    if retry_after is not None:
        head.append(b"retry-after: %d" % retry_after)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def connection_protocol(read_timeout_s=30.0, per_client=64, total=1024, on_refused=None):
    """The protocol class for uvicorn's ``http=``, with its own count of open connections per
    client (one class per server); ``on_refused(status)`` is told of every refusal and timeout."""
    if not read_timeout_s > 0:
        raise ValueError(f"read_timeout_s: expected seconds > 0, got {read_timeout_s!r}")
    open_by_client = {}

    class CappedH11Protocol(H11Protocol):
        _read_deadline = None           # TimerHandle while a request is being received
        _request_bytes = False          # whether some of that request has arrived
        _counted = False                # whether open_by_client counts this connection
        _refusal = None                 # (status, message, code, type) of a connection over a cap

        def connection_made(self, transport):
            super().connection_made(transport)
            self._key = self.client[0] if self.client else None
            self._counted = True
            open_by_client[self._key] = open_by_client.get(self._key, 0) + 1
            if open_by_client[self._key] > per_client:
                self._refusal = (429, f"this client has {per_client} connections open already (the limit): "
                                      "close one, or try again later", "too_many_connections", "rate_limit_error")
            elif len(self.connections) > total:
                self._refusal = (503, f"the server has {total} connections open (the limit): try again later",
                                 "server_busy", "server_error")
            self._start_deadline()

        def connection_lost(self, exc):
            self._stop_deadline()
            if self._counted:
                self._counted = False
                left = open_by_client.get(self._key, 0) - 1
                if left > 0:
                    open_by_client[self._key] = left
                else:
                    open_by_client.pop(self._key, None)
            super().connection_lost(exc)

        def data_received(self, data):
            if self._refusal is not None:
                # answered once the request's first bytes are read: closing with them unread would
                # reset the connection, and the client would lose the answer
                self._refuse(*self._refusal)
                return
            super().data_received(data)
            if self.transport.is_closing():
                self._stop_deadline()
            elif self.conn.their_state in (h11.IDLE, h11.SEND_BODY):     # a request not whole yet
                self._request_bytes = True
                self._start_deadline()
            else:                                   # the request is in: answering has no deadline
                self._stop_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._request_bytes = False             # the next request's clock starts at its first byte

        # -- the deadline ---------------------------------------------------------
        def _start_deadline(self):
            if self._read_deadline is None:
                self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _stop_deadline(self):
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self):
            self._read_deadline = None
            if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                return
            # a 408 only to a request that began and has no answer yet: an idle connection gets none,
            # nor one whose route answered without reading the body (a 404, a 401): one answer each
            if self._request_bytes and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):     # none sent
                if on_refused is not None:
                    on_refused(408)
                self.transport.write(raw_response(
                    408, f"the request did not arrive within {read_timeout_s:g} s of its first byte",
                    "request_timeout"))
            self.transport.close()

        def send_400_response(self, msg):
            # a request h11 cannot parse: uvicorn answers in plain text; the API's clients read OpenAI's shape
            if on_refused is not None:
                on_refused(400)
            self.transport.write(raw_response(400, f"not an HTTP/1.1 request llambda can read: {msg}",
                                              "invalid_http_request"))
            self.transport.close()

        def _refuse(self, status, message, code, type):
            self._stop_deadline()
            if self.transport.is_closing():
                return
            if on_refused is not None:
                on_refused(status)
            self.transport.write(raw_response(status, message, code, type, retry_after=RETRY_AFTER_S))
            self.transport.close()

    return CappedH11Protocol

