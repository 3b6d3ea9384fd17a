"""A worker's HTTP endpoints, one module each, over one shared base (`base.py`: running a request's choices,
whole and streamed answers, the usage, errors in a stream).

- `completions.py`  `POST /v1/completions`: text offsets, completion logprobs and `echo`;
- `chat.py`         `POST /v1/chat/completions`: the assistant's role, chat logprobs, tool calls;
- `responses.py`    `POST /v1/responses` and its stored responses (the Responses API, run as a chat);
- `generate.py`     `POST /generate`, the native endpoint;
- `tokenize.py`     `POST /tokenize` and `/detokenize`.

Each endpoint hands `base.respond` (or, for the Responses API and /generate, the base's parts) its own answer
format per request, so the shared code never asks which endpoint it serves. `server/api.py` puts them on the app.
"""
