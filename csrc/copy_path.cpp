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
// The stream rules are the engine's (lmsrt/engine/__init__.py, NOTE [ Stream lifetimes ]); the functions
// below only carry them out:
//   copy_out: Rule 1 - the D2H stream waits on the compute stream's progress before reading.
//   copy_in:  Rule 3 - the H2D stream waits on the compute stream's progress before writing the
//             block (which the caller allocated with the compute stream current).
// Returned events are what Rules 2-4 wait on; the engine keeps the returned source / block.

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#ifdef LMSRT_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <pythread.h>

#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

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

// The allocator's counters that the engine reads at each step's start and end: (peak allocated
// bytes, allocation retries, failed allocations), without the stats dictionary (~50 us a read).
std::tuple<int64_t, int64_t, int64_t> allocator_counts(c10::DeviceIndex index) {
  const auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(index);
  return {stats.allocated_bytes[kAggregate].peak, stats.num_alloc_retries, stats.num_ooms};
}

// ---- Saved-tensor hooks for a step that keeps everything (lmsrt/engine/native.py, NOTE [ Steps that
// keep everything ]). The engine's Python hooks cost ~6 us a saved tensor; a model that fits its
// cap saves hundreds a step, and its forward runs on the CPU's time. These hooks do what the
// Python ones do for such a step, in C++: decide that a saved tensor stays, check the step still
// follows the plan and GPU use stays under the policy's level, and hand back a handle that
// unpack checks for in-place changes: a tuple (tensor, version, grad_fn name or None, output
// number, thread), the tensor detached if it has a grad_fn (a saved output must not hold its own
// node). A tuple costs less than any object of a class of ours. Anything else (a subclass, a storage whose size or level
// says the plan no longer holds, another thread, a step not armed) goes to the Python hooks,
// after the engine has taken over what was counted here (``take``).

class Keeper {
 public:
  // ``take_over(t)``: the engine's pack after it has taken over (Python). ``slow_unpack(ref)``:
  // its unpack. ``after_backward``: its set of threads whose saved tensors backward has used.
  // ``memory``: None to read the allocator's bytes of ``device``, else a callable (the
  // simulated device of the tests), as is ``note_saved``.
  Keeper(const at::Device& device, int64_t min_bytes, py::object take_over,
         py::object slow_unpack, py::object after_backward, py::object memory,
         py::object note_saved)
      : device_(device),
        min_bytes_(min_bytes),
        take_over_(std::move(take_over)),
        slow_unpack_(std::move(slow_unpack)),
        after_backward_(std::move(after_backward)),
        memory_(std::move(memory)),
        note_saved_(std::move(note_saved)) {}

  // Packs on this thread from forward point ``index`` on are decided here, against the plan's
  // ``sizes`` and the policy's swap ``levels`` (one each per point), ``live`` the points whose
  // storage outlives backward anyway. ``kept``: [(storage, version)] the engine kept in this
  // forward before arming: saved again, each is the storage it kept, not another point (the
  // first save of a Llama's hidden state, saved again by its norm after the hooks armed, took a
  // point of its own here and every lean step of the Trainer left its plan there).
  void arm(std::vector<int64_t> sizes, std::vector<int64_t> levels, std::vector<int64_t> live,
           int64_t index, py::list kept) {
    TORCH_CHECK(sizes.size() == levels.size(), "lmsrt keeper: sizes and levels differ in length");
    clear();
    for (py::handle item : kept) {
      py::tuple pair = py::reinterpret_borrow<py::tuple>(item);
      const c10::Storage& storage = THPStorage_Unpack(pair[0].ptr());
      by_ptr_.insert_or_assign(storage.data(),
                               Entry{storage.getWeakStorageImpl(), pair[1].cast<int64_t>()});
    }
    sizes_ = std::move(sizes);
    levels_ = std::move(levels);
    live_ = std::unordered_set<int64_t>(live.begin(), live.end());
    index_ = index;
    thread_ident_ = PyThread_get_thread_ident();
    thread_ = py::int_(thread_ident_);
    armed_ = true;
  }

  // Unpacks of kept handles are checked here from now on (``fast``), or all go to Python.
  void backward(bool fast) { fast_unpack_ = fast; }

  bool armed() const { return armed_; }

  // The forward point the next storage saved here gets (the engine's ``save_point``).
  int64_t index() const { return index_; }

  py::object engine() const { return take_over_.attr("__self__"); }

  // Disarm; return (next forward point, sizes recorded, [(storage, version)] kept if
  // ``entries``, (kept bytes, kept tensors, live bytes, live tensors, skipped tensors),
  // (largest bytes, its point)).
  py::tuple take(bool entries) {
    armed_ = false;
    py::list kept;
    if (entries) {
      for (auto& item : by_ptr_) {
        c10::intrusive_ptr<c10::StorageImpl> impl = item.second.storage.lock();
        if (impl) {
          kept.append(py::make_tuple(
              py::reinterpret_steal<py::object>(THPStorage_Wrap(c10::Storage(std::move(impl)))),
              item.second.version));
        }
      }
    }
    py::tuple out = py::make_tuple(
        index_, py::cast(recorded_), kept,
        py::make_tuple(kept_bytes_, kept_tensors_, live_bytes_, live_tensors_, skipped_),
        py::make_tuple(largest_bytes_, largest_index_));
    clear();
    return out;
  }

  py::object pack(py::handle obj) {
    if (!armed_ || PyThread_get_thread_ident() != thread_ident_) {
      return take_over_(obj);
    }
    PyTypeObject* type = Py_TYPE(obj.ptr());
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (type == reinterpret_cast<PyTypeObject*>(ParameterClass)) {
      ++skipped_;
      return kept_ref(t);
    }
    if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) || t.is_nested()) {
      return take_over_(obj);  // the engine says once that it cannot swap these
    }
    if (t.device() != device_ || t.layout() != at::kStrided || t.is_conj() || t.is_neg() ||
        t.is_quantized()) {
      ++skipped_;
      return kept_ref(t);
    }
    const at::TensorBase& base = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
    if (base.requires_grad() && base.is_leaf()) {
      ++skipped_;  // trainable leaves and views of them
      return kept_ref(t);
    }
    const c10::Storage& storage = t.storage();
    const int64_t nbytes = static_cast<int64_t>(storage.nbytes());
    if (nbytes < min_bytes_) {
      ++skipped_;
      return kept_ref(t);
    }
    const int64_t version = t._version();
    const void* key = storage.data();
    auto found = by_ptr_.find(key);
    if (found != by_ptr_.end() && found->second.version == version &&
        found->second.storage.lock().get() == storage.unsafeGetStorageImpl()) {
      return kept_ref(t);  // a storage already kept in this forward
    }
    const int64_t i = index_;
    if (i >= static_cast<int64_t>(sizes_.size()) || sizes_[i] != nbytes) {
      return take_over_(obj);  // the step no longer follows the plan
    }
    if (!note_saved_.is_none()) {
      note_saved_(py::reinterpret_steal<py::object>(THPStorage_Wrap(storage)));
    }
    if (used() > levels_[i]) {
      return take_over_(obj);  // over the policy's level: the engine swaps
    }
    ++index_;
    recorded_.push_back(nbytes);
    if (nbytes > largest_bytes_) {
      largest_bytes_ = nbytes;
      largest_index_ = i;
    }
    if (live_.count(i)) {
      live_bytes_ += nbytes;
      ++live_tensors_;
    } else {
      kept_bytes_ += nbytes;
      ++kept_tensors_;
    }
    by_ptr_.insert_or_assign(key, Entry{storage.getWeakStorageImpl(), version});
    return kept_ref(t);
  }

  py::object unpack(py::handle ref) {
    PyObject* handle = ref.ptr();
    if (!fast_unpack_ || !PyTuple_CheckExact(handle) || PyTuple_GET_SIZE(handle) != 5) {
      return slow_unpack_(ref);
    }
    PyObject* tensor = PyTuple_GET_ITEM(handle, 0);
    if (THPVariable_Unpack(tensor)._version() != PyLong_AsLongLong(PyTuple_GET_ITEM(handle, 1))) {
      return slow_unpack_(ref);  // the engine raises autograd's in-place error
    }
    if (PySet_Add(after_backward_.ptr(), PyTuple_GET_ITEM(handle, 4)) != 0) {
      throw py::error_already_set();
    }
    return py::reinterpret_borrow<py::object>(tensor);
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t version;
  };

  py::object kept_ref(const at::Tensor& t) const {
    const auto& fn = t.grad_fn();
    PyObject* handle = PyTuple_New(5);
    if (handle == nullptr) {
      throw py::error_already_set();
    }
    PyObject* name = Py_None;
    int64_t output_nr = 0;
    if (fn) {
      PyTuple_SET_ITEM(handle, 0, THPVariable_Wrap(t.tensor_data()));
      const std::string producer = fn->name();
      name = PyUnicode_FromStringAndSize(producer.data(), static_cast<Py_ssize_t>(producer.size()));
      output_nr = t.output_nr();
    } else {
      PyTuple_SET_ITEM(handle, 0, THPVariable_Wrap(t));
      Py_INCREF(name);
    }
    PyTuple_SET_ITEM(handle, 1, PyLong_FromLongLong(t._version()));
    PyTuple_SET_ITEM(handle, 2, name);
    PyTuple_SET_ITEM(handle, 3, PyLong_FromLongLong(output_nr));
    Py_INCREF(thread_.ptr());
    PyTuple_SET_ITEM(handle, 4, thread_.ptr());
    py::object out = py::reinterpret_steal<py::object>(handle);
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return out;
  }

  int64_t used() const {
    if (!memory_.is_none()) {
      return memory_().cast<int64_t>();
    }
    return c10::getDeviceAllocator(device_.type())
        ->getDeviceStats(device_.index())
        .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .current;
  }

  void clear() {
    by_ptr_.clear();
    recorded_.clear();
    kept_bytes_ = kept_tensors_ = live_bytes_ = live_tensors_ = skipped_ = 0;
    largest_bytes_ = largest_index_ = 0;
  }

  at::Device device_;
  int64_t min_bytes_;
  py::object take_over_, slow_unpack_, after_backward_, memory_, note_saved_;
  bool armed_ = false;
  bool fast_unpack_ = false;
  unsigned long thread_ident_ = 0;
  py::int_ thread_;             // the same, as autograd's handles carry it
  std::vector<int64_t> sizes_, levels_, recorded_;
  std::unordered_set<int64_t> live_;
  std::unordered_map<const void*, Entry> by_ptr_;
  int64_t index_ = 0;
  int64_t kept_bytes_ = 0, kept_tensors_ = 0, live_bytes_ = 0, live_tensors_ = 0, skipped_ = 0;
  int64_t largest_bytes_ = 0, largest_index_ = 0;
};

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
  m.def("allocator_counts", &allocator_counts,
        "the allocator's (peak allocated bytes, allocation retries, failed allocations)");
  py::class_<Keeper>(m, "Keeper")
      .def(py::init<const at::Device&, int64_t, py::object, py::object, py::object, py::object,
                    py::object>())
      .def("arm", &Keeper::arm)
      .def("backward", &Keeper::backward)
      .def_property_readonly("armed", &Keeper::armed)
      .def_property_readonly("index", &Keeper::index)
      .def_property_readonly("engine", &Keeper::engine)
      .def("take", &Keeper::take)
      .def("pack", &Keeper::pack)
      .def("unpack", &Keeper::unpack);
}
