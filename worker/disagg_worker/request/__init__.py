"""What a request is, shared by the HTTP processes, the router and the engine: its sampling parameters
(`params`), the limits it is held to (`limits`), the messages that carry it between processes (`messages`),
the routing fields the router adds and the workers read (`route`), and the errors it can meet, in OpenAI's
shape (`errors`). It imports nothing of the engine, the server or the router: they all import it.
"""
