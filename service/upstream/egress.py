"""The egress proxy an upstream origin is reached through. It comes from the environment, the way
curl, requests and the openai SDK read it: `HTTPS_PROXY` for https:// origins, `HTTP_PROXY` for
http:// ones (either case; the lower-case name wins), and `NO_PROXY` for hosts that go direct (names,
domain suffixes, and, as curl reads them, IP ranges such as `10.0.0.0/8`).

The proxy must be an http:// URL, optionally with `user:password@`, sent as Basic
`Proxy-Authorization`. An https:// origin goes through a CONNECT tunnel, and TLS runs inside it
end to end. An http:// origin's requests are sent to the proxy in absolute form.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit
from urllib.request import getproxies_environment, proxy_bypass_environment

MAX_ANSWER_HEAD = 64 * 1024


class TunnelRefused(ConnectionError):
    """The egress proxy did not open the tunnel; the message says what it answered."""


@dataclass(frozen=True, slots=True)
class EgressProxy:
    host: str
    port: int
    authorization: str | None  # the Proxy-Authorization value; never in a message or a log

    @property
    def address(self) -> str:
        """What errors name: host and port, no credentials."""
        return f"{self.host}:{self.port}"


def egress_proxy(scheme: str, host: str) -> EgressProxy | None:
    """The proxy for `scheme://host` from the environment, or None to connect directly. ValueError,
    naming the variable, for a proxy URL that is not http://."""
    proxies = getproxies_environment()
    url = proxies.get(scheme)
    if not url or proxy_bypass_environment(host, proxies) or _in_no_proxy_range(host, proxies.get("no", "")):
        return None
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{scheme.upper()}_PROXY must be an http:// proxy URL (got a {parts.scheme}:// one)")
    authorization = None
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        authorization = "Basic " + base64.b64encode(credentials).decode("ascii")
    return EgressProxy(parts.hostname, parts.port or 80, authorization)


def _in_no_proxy_range(host: str, no_proxy: str) -> bool:
    """Whether IP address `host` is in one of NO_PROXY's CIDR ranges (urllib reads names only)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in no_proxy.split(","):
        entry = entry.strip()
        if "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False


async def tunnel(loop: asyncio.AbstractEventLoop, proxy: EgressProxy, host: str, port: int) -> socket.socket:
    """A socket connected to `host:port` through the proxy's CONNECT, ready for the TLS handshake."""
    sock = await _connected(loop, proxy)
    try:
        target = f"[{host}]:{port}" if ":" in host else f"{host.encode('idna').decode('ascii')}:{port}"
        head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        if proxy.authorization:
            head += f"Proxy-Authorization: {proxy.authorization}\r\n"
        await loop.sock_sendall(sock, (head + "\r\n").encode("latin-1"))
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = await loop.sock_recv(sock, 4096)
            if not data:
                raise TunnelRefused(f"the egress proxy {proxy.address} closed the connection during CONNECT")
            answer += data
            if len(answer) > MAX_ANSWER_HEAD:
                raise TunnelRefused(f"the egress proxy {proxy.address} sent an endless answer to CONNECT")
        status = answer.split(b"\r\n", 1)[0].decode("latin-1")
        code = status.split(" ", 2)[1] if status.count(" ") >= 1 else ""
        if not (code.isdigit() and 200 <= int(code) < 300):
            raise TunnelRefused(f"the egress proxy {proxy.address} refused CONNECT {target}: {status[:120]}")
        if not answer.endswith(b"\r\n\r\n"):
            raise TunnelRefused(f"the egress proxy {proxy.address} sent bytes after its answer to CONNECT")
    except BaseException:
        sock.close()
        raise
    return sock


async def _connected(loop: asyncio.AbstractEventLoop, proxy: EgressProxy) -> socket.socket:
    last: OSError = OSError(f"no address for {proxy.host}")
    for family, kind, proto, _, address in await loop.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            last = e
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise last
