from cluster.transport.completion import work_error


class _Work:
    """A torch.distributed work object as seen after it finished."""

    def __init__(self, exc=None, binding_broken=False):
        self.exc, self.binding_broken = exc, binding_broken

    def is_completed(self):
        return True

    def exception(self):
        if self.binding_broken:  # torch 2.11: the exception_ptr cannot be converted
            raise TypeError("Unable to convert function return value to a Python type!")
        return self.exc

    def is_success(self):
        raise NotImplementedError("WorkNCCL::isSuccess() is deprecated")

    def get_future_result(self):
        from concurrent.futures import Future

        class _F(Future):
            def value(self):
                return self.result()

        f = _F()
        f.set_result(0 if self.exc is None else 2)  # WorkResult.SUCCESS / COMM_ERROR
        return f


def test_work_error_reads_the_exception():
    assert work_error(_Work()) is None
    assert "RuntimeError: NCCL communicator was aborted" == work_error(_Work(RuntimeError("NCCL communicator was aborted")))


def test_work_error_falls_back_to_the_result_future_where_exception_cannot_be_read():
    assert work_error(_Work(binding_broken=True)) is None
    assert "failed" in work_error(_Work(RuntimeError("x"), binding_broken=True))


def test_a_work_object_that_raises_is_an_error():
    class Broken(_Work):
        def is_completed(self):
            raise RuntimeError("gone")

    assert work_error(Broken()) == "RuntimeError: gone"


def test_an_unreadable_result_is_no_error():
    class Unreadable(_Work):
        def get_future_result(self):
            raise RuntimeError("ProcessGroup work getFutureResult not implemented")

    assert work_error(Unreadable(RuntimeError("x"), binding_broken=True)) is None


def test_a_completion_put_on_a_stopped_waiter_still_runs_its_callback():
    """A pair given up (re-formed, its peer restarted) while a bundle on it was still committing: the
    bundle's callback resolves its transfer's futures, so it must run even after the waiter stopped."""
    import threading

    from cluster.transport.completion import ReadyCompletion, Waiter

    w = Waiter("kv-wait-test")
    w.start()
    ran = [threading.Event(), threading.Event()]
    w.put(ReadyCompletion(), ran[0].set)
    w.stop()
    w.join(5)
    assert not w.is_alive() and ran[0].is_set()
    w.put(ReadyCompletion(), ran[1].set)  # after the stop
    assert ran[1].wait(5)
