"""The channel between the K gateway processes and the one router (typed msgspec frames over ZMQ).

    messages.py   the frames, and the one error codec (an error crosses by its registered kind)
    client.py     RouterClient: a gateway's end (DEALER): calls, one-way frames, heartbeats
    server.py     RouterServer: the router's end (ROUTER), serving every gateway; step records in
"""
