"""Fixtures shared by the picker's tests."""
import pytest

EXT_PROC_SERVERS = ["native", "python"]


@pytest.fixture(params=EXT_PROC_SERVERS)
def ext_proc_server(request):
    """Each ext_proc black-box test runs against both servers: the compiled transport
    (`native`, the default) and the pure-Python fallback (`python`)."""
    return request.param
