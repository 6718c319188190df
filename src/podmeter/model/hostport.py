"""``HOST:PORT`` as every address of podmeter is written: an IPv6 host in brackets (``[fd00::1]:4246``)."""


def host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
