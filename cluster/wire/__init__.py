"""What crosses a process boundary: the typed messages per hop, the token stream's messages, frame signing, socket bounds."""
