"""Broken OpenEnv servers on loopback, real processes for the failure tests (tests/test_openenv.py):

    python tests/openenv_faulty.py 500 --port N        # every HTTP request answered 500, the /ws upgrade too
    python tests/openenv_faulty.py hang --port N       # connections accepted, nothing ever answered
    python tests/openenv_faulty.py MODE --on step --port N

MODE garbage, stall, drop, wrong, freeze or exit: the guess server (tests/openenv_guess.py), whose /health and
/schema work, but whose websocket answers each message of a type --on lists with non-JSON, nothing, a closed
connection, or JSON of the wrong shape (a string for the reward); or, at the first such message, the whole
process stops (SIGSTOP: not even a TCP close) or exits. Other messages are answered as the game does."""
import argparse
import http.server
import json
import os
import signal
import socket
import time

GARBAGE = "<html><body>502 Bad Gateway</body></html>"
WRONG = json.dumps({"type": "observation", "data": {"observation": {"text": "Again?"}, "reward": "lots"}})


class Answer500(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"                   # as a proxy would; websockets rejects any HTTP/1.0 reply
    def do_GET(self):                               # the /ws upgrade is a GET too
        self.send_error(500, "Internal Server Error")

    do_POST = do_GET

    def log_message(self, *args):
        pass


def faulty(app, mode, on):
    """app, an ASGI app, with its websocket messages of the types in `on` answered by `mode` instead."""
    async def wrapped(scope, receive, send):
        async def filtered():                       # what the app reads: the messages left to it
            while True:
                message = await receive()
                if message["type"] != "websocket.receive" or json.loads(message["text"])["type"] not in on:
                    return message
                if mode == "freeze":                # the process, not the session: all its sessions at once
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif mode == "exit":
                    os._exit(1)
                elif mode == "drop":
                    await send({"type": "websocket.close", "code": 1011})
                elif mode != "stall":               # stall: no answer, ever; the client's timeout ends it
                    await send({"type": "websocket.send", "text": GARBAGE if mode == "garbage" else WRONG})
        await app(scope, filtered if scope["type"] == "websocket" else receive, send)
    return wrapped


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A broken OpenEnv server on 127.0.0.1")
    parser.add_argument("mode", choices=["500", "hang", "garbage", "stall", "drop", "wrong", "freeze",
                                         "exit"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--on", default="reset,step", help="garbage ... exit: the message types hit")
    args = parser.parse_args()
    if args.mode == "500":
        http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Answer500).serve_forever()
    elif args.mode == "hang":
        listening = socket.create_server(("127.0.0.1", args.port), backlog=256)   # the kernel accepts
        time.sleep(1e9)
    else:
        import uvicorn
        from openenv_guess import app
        uvicorn.run(faulty(app, args.mode, args.on.split(",")), host="127.0.0.1", port=args.port,
                    log_level="warning")
