"""Where the run's sockets listen: on the address its peers use, never on every interface."""

from __future__ import annotations

import ipaddress
import socket


def listen_address(host: str, *, given_as: str) -> str:
    """The address to listen on for peers that reach this machine as `host`: `host` itself when
    it is an address or `localhost`; otherwise the first address `host` resolves to here that is
    not loopback. A name that resolves to loopback only is refused (`given_as` names where it
    came from): peers on other machines could not reach a socket there (Debian's hosts file maps
    the machine's own name to 127.0.1.1)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if host == "localhost":
        return "127.0.0.1"
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"{given_as}: {host!r} does not resolve here ({error})") from None
    addresses = [info[4][0] for info in found]
    for address in addresses:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    raise ValueError(
        f"{given_as}: {host!r} resolves to {', '.join(addresses)} here, loopback only, which "
        "other machines cannot reach; map the name to this machine's cluster address in DNS or "
        "the hosts file"
    )


def listening_socket(host: str, *, given_as: str) -> socket.socket:
    """A TCP socket listening on `listen_address(host)` at a port the system picks (read it
    with `getsockname()`): no port is probed and released for another process to take."""
    address = listen_address(host, given_as=given_as)
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen()
    except BaseException:
        listener.close()
        raise
    return listener
