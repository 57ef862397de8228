from cluster.transport.base import KVArrival, KVTransport, TransferStats

__all__ = ["KVArrival", "KVTransport", "TransferStats"]
