"""The receiving side of the ZMQ sockets: the receive loop and a gateway's token-stream receiver."""
