// The per-tensor CUDA calls of the swap engine, in one native call each.
//
// From Python, swapping one saved storage out costs ~30 us of CPU, ~18 us of it in torch's Python
// bindings for a handful of CUDA calls (a storage view, an event record, a stream wait, a stream
// switch, the copy, another record: benchmarks/pack_overhead.py --primitives). Here the same
// calls cost a few microseconds. Events, streams and the allocator's counters go through
// device-generic c10 APIs (c10::Event, c10::Stream, c10::DeviceAllocator). The copy itself is one
// cudaMemcpyAsync when built against a CUDA build of torch (LMSRT_CUDA, what `lmsrt build` does
// there): ATen's copy_ spends several microseconds more checking and dispatching a byte copy
// between two contiguous buffers. Built against a CPU-only torch, copy_ stands in, so the module
// still compiles and its other calls can be tested.
//
// The stream rules are the engine's (lmsrt/engine.py, NOTE [ Stream lifetimes ]); the functions
// below only carry them out:
//   copy_out: Rule 1 - the D2H stream waits on the compute stream's progress before reading.
//   copy_in:  Rule 3 - the H2D stream waits on the compute stream's progress before writing the
//             block (which the caller allocated with the compute stream current).
// Returned events are what Rules 2-4 wait on; the engine keeps the returned source / block.

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/utils/pybind.h>

#ifdef LMSRT_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <tuple>

namespace py = pybind11;

namespace {

// A CUDA event, usable where the engine uses torch.cuda.Event: query(), and wait(stream), which
// torch.cuda.Stream.wait_event(event) calls.
struct Event {
  c10::Event event{c10::DeviceType::CUDA};

  bool query() const { return event.query(); }
  void wait(const c10::Stream& stream) const { event.block(stream); }
  void record(const c10::Stream& stream) { event.record(stream); }
  void synchronize() const { event.synchronize(); }
};

// The whole storage as a flat byte tensor: what is copied, and what keeps the source alive.
at::Tensor bytes_of(const at::Storage& storage, const at::Device& device) {
  auto flat = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device));
  flat.set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
  return flat;
}

// Copies the bytes of ``gpu`` to (D2H) or from (H2D) the same number of bytes at ``offset`` in the
// pinned slab ``slab``, queued on ``stream``.
void copy_bytes(const at::Tensor& gpu, const at::Tensor& slab, int64_t offset, bool to_host,
                const c10::Stream& stream) {
  const int64_t nbytes = static_cast<int64_t>(gpu.nbytes());
  TORCH_CHECK(offset >= 0 && offset + nbytes <= static_cast<int64_t>(slab.nbytes()),
              "lmsrt copy path: ", nbytes, " bytes at offset ", offset, " overrun a slab of ",
              slab.nbytes());
#ifdef LMSRT_CUDA
  c10::DeviceGuard on_device(stream.device());
  char* host = static_cast<char*>(slab.data_ptr()) + offset;
  C10_CUDA_CHECK(cudaMemcpyAsync(to_host ? host : gpu.data_ptr(),
                                 to_host ? gpu.const_data_ptr() : host, nbytes,
                                 to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                 c10::cuda::CUDAStream(stream).stream()));
#else
  c10::StreamGuard on_stream(stream);
  at::Tensor host = slab.narrow(0, offset, nbytes);
  if (to_host) {
    host.copy_(gpu, /*non_blocking=*/true);
  } else {
    at::Tensor(gpu).copy_(host, /*non_blocking=*/true);
  }
#endif
}

std::tuple<at::Tensor, Event> copy_out(const at::Storage& storage, const at::Tensor& slab,
                                       int64_t offset, Event& ready, const c10::Stream& compute,
                                       const c10::Stream& d2h) {
  at::Tensor source = bytes_of(storage, compute.device());
  ready.event.record(compute);
  ready.event.block(d2h);  // Rule 1
  copy_bytes(source, slab, offset, /*to_host=*/true, d2h);
  Event done;
  done.event.record(d2h);
  return {std::move(source), std::move(done)};
}

// The block comes from the caller, allocated with the compute stream current (Rule 3), so that
// running out of memory raises torch.OutOfMemoryError there, as the engine expects.
Event copy_in(const at::Tensor& block, const at::Tensor& slab, int64_t offset, Event& ready,
              const c10::Stream& compute, const c10::Stream& h2d) {
  ready.event.record(compute);
  ready.event.block(h2d);
  copy_bytes(block, slab, offset, /*to_host=*/false, h2d);
  Event done;
  done.event.record(h2d);
  return done;
}

// A view of a restored block with the saved tensor's dtype, shape, strides and offset.
at::Tensor view(const at::Tensor& block, at::ScalarType dtype, at::IntArrayRef size,
                at::IntArrayRef stride, int64_t offset) {
  auto out = at::empty({0}, block.options().dtype(dtype));
  out.set_(block.storage(), offset, size, stride);
  return out;
}

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

// Bytes the caching allocator has handed out on a device: torch.cuda.memory_allocated() without
// building the stats dictionary (~0.5 us against ~12 us).
int64_t memory_allocated(c10::DeviceIndex index) {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA)
      ->getDeviceStats(index)
      .allocated_bytes[kAggregate]
      .current;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmsrt's per-tensor CUDA copy path (see csrc/copy_path.cpp)";
#ifdef LMSRT_CUDA
  m.attr("raw_copies") = true;
#else
  m.attr("raw_copies") = false;
#endif
  py::class_<Event>(m, "Event")
      .def(py::init<>())
      .def("query", &Event::query)
      .def("wait", &Event::wait)
      .def("record", &Event::record)
      .def("synchronize", &Event::synchronize);
  m.def("copy_out", &copy_out, "D2H copy of a whole storage after the compute stream's work");
  m.def("copy_in", &copy_in, "H2D copy into a block, after the compute stream's work");
  m.def("view", &view, "a dtype/shape/stride/offset view of a block's storage");
  m.def("memory_allocated", &memory_allocated, "the allocator's current allocated bytes");
}
