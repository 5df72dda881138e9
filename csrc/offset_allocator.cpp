// Native best-fit offset allocator, exposed to Python as lmsrt._native.OffsetAllocator.
//
// It hands out byte offsets inside one contiguous region (a pinned host slab)
// without touching the memory itself.  Behaviour must match
// lmsrt/arena.py:PyOffsetAllocator exactly; tests/test_arena.py runs both side
// by side on the same operation stream.
//
// Free blocks are indexed twice: by offset (to find the neighbours to coalesce
// with on free) and by (size, offset) (so best fit with lowest-offset
// tie-breaking is a single lower_bound).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

class OffsetAllocator {
 public:
  OffsetAllocator(int64_t capacity, int64_t alignment) {
    if (capacity <= 0) {
      throw py::value_error("capacity must be > 0, got " + std::to_string(capacity));
    }
    if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
      throw py::value_error("alignment must be a power of two > 0, got " +
                            std::to_string(alignment));
    }
    capacity_ = static_cast<uint64_t>(capacity);
    alignment_ = static_cast<uint64_t>(alignment);
    insert_free(0, capacity_);
  }

  int64_t alloc(int64_t nbytes) {
    if (nbytes <= 0) {
      throw py::value_error("nbytes must be > 0, got " + std::to_string(nbytes));
    }
    // Checked before rounding so that huge requests cannot overflow.
    if (static_cast<uint64_t>(nbytes) > capacity_) {
      return -1;
    }
    const uint64_t size = round_up(static_cast<uint64_t>(nbytes));
    auto best = free_by_size_.lower_bound({size, 0});
    if (best == free_by_size_.end()) {
      return -1;
    }
    const uint64_t block_size = best->first;
    const uint64_t offset = best->second;
    free_by_size_.erase(best);
    free_by_offset_.erase(offset);
    if (block_size > size) {
      insert_free(offset + size, block_size - size);
    }
    allocated_.emplace(offset, size);
    used_bytes_ += size;
    return static_cast<int64_t>(offset);
  }

  void free(int64_t offset_arg) {
    auto found = find_allocated(offset_arg);
    uint64_t offset = found->first;
    uint64_t size = found->second;
    allocated_.erase(found);
    used_bytes_ -= size;

    auto next = free_by_offset_.lower_bound(offset);
    if (next != free_by_offset_.end() && next->first == offset + size) {
      size += next->second;
      erase_free(next);
      next = free_by_offset_.lower_bound(offset);
    }
    if (next != free_by_offset_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        size += prev->second;
        erase_free(prev);
      }
    }
    insert_free(offset, size);
  }

  int64_t size_of(int64_t offset) const {
    return static_cast<int64_t>(find_allocated(offset)->second);
  }

  int64_t capacity() const { return static_cast<int64_t>(capacity_); }
  int64_t alignment() const { return static_cast<int64_t>(alignment_); }
  int64_t used_bytes() const { return static_cast<int64_t>(used_bytes_); }
  int64_t free_bytes() const { return static_cast<int64_t>(capacity_ - used_bytes_); }
  int64_t num_allocations() const { return static_cast<int64_t>(allocated_.size()); }

  int64_t largest_free() const {
    return free_by_size_.empty() ? 0 : static_cast<int64_t>(free_by_size_.rbegin()->first);
  }

  std::vector<std::pair<int64_t, int64_t>> free_blocks() const {
    std::vector<std::pair<int64_t, int64_t>> blocks;
    blocks.reserve(free_by_offset_.size());
    for (const auto& [offset, size] : free_by_offset_) {
      blocks.emplace_back(static_cast<int64_t>(offset), static_cast<int64_t>(size));
    }
    return blocks;
  }

 private:
  using AllocatedMap = std::unordered_map<uint64_t, uint64_t>;

  uint64_t round_up(uint64_t nbytes) const {
    return (nbytes + alignment_ - 1) & ~(alignment_ - 1);
  }

  AllocatedMap::const_iterator find_allocated(int64_t offset) const {
    auto found = offset < 0 ? allocated_.end() : allocated_.find(static_cast<uint64_t>(offset));
    if (found == allocated_.end()) {
      throw py::key_error("offset " + std::to_string(offset) + " is not allocated");
    }
    return found;
  }

  void insert_free(uint64_t offset, uint64_t size) {
    free_by_offset_.emplace(offset, size);
    free_by_size_.emplace(size, offset);
  }

  void erase_free(std::map<uint64_t, uint64_t>::iterator block) {
    free_by_size_.erase({block->second, block->first});
    free_by_offset_.erase(block);
  }

  uint64_t capacity_ = 0;
  uint64_t alignment_ = 0;
  uint64_t used_bytes_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;            // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;   // (size, offset)
  AllocatedMap allocated_;                                 // offset -> rounded size
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native components of lmsrt (best-fit offset allocator).";

  py::class_<OffsetAllocator>(m, "OffsetAllocator",
                              "Best-fit allocator of aligned byte offsets inside a fixed-capacity region.")
      .def(py::init<int64_t, int64_t>(), py::arg("capacity"), py::arg("alignment") = 512)
      .def("alloc", &OffsetAllocator::alloc, py::arg("nbytes"),
           "Reserve nbytes (rounded up to the alignment); return the offset, or -1 if nothing fits.")
      .def("free", &OffsetAllocator::free, py::arg("offset"),
           "Release the block at offset, coalescing with free neighbours; KeyError if not allocated.")
      .def("size_of", &OffsetAllocator::size_of, py::arg("offset"),
           "Rounded size of the allocated block at offset; KeyError if not allocated.")
      .def("free_blocks", &OffsetAllocator::free_blocks,
           "Free blocks as (offset, size) tuples sorted by offset.")
      .def_property_readonly("capacity", &OffsetAllocator::capacity)
      .def_property_readonly("alignment", &OffsetAllocator::alignment)
      .def_property_readonly("used_bytes", &OffsetAllocator::used_bytes)
      .def_property_readonly("free_bytes", &OffsetAllocator::free_bytes)
      .def_property_readonly("largest_free", &OffsetAllocator::largest_free)
      .def_property_readonly("num_allocations", &OffsetAllocator::num_allocations);
}
