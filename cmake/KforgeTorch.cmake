# Where the build's Python keeps torch, for kforge._dispatch: headers, libraries, the C++ ABI
# and the version. Asks torch itself (torch.utils.cpp_extension) instead of find_package(Torch),
# which would go looking for a CUDA toolkit. Sets KFORGE_TORCH_FOUND, and when found
# KFORGE_TORCH_INCLUDE_DIRS, KFORGE_TORCH_LIBRARY_DIRS, KFORGE_TORCH_CXX11_ABI and
# KFORGE_TORCH_VERSION; otherwise KFORGE_TORCH_ERROR says why.
function(kforge_find_torch)
  set(script [=[
import torch, torch.utils.cpp_extension as ext
print(torch.__version__)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(":".join(ext.include_paths()))
print(":".join(ext.library_paths()))
]=])
  # Run outside the source tree: a directory with a torch/ or types.py in it would shadow modules.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "${script}"
    WORKING_DIRECTORY "${CMAKE_BINARY_DIR}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    string(REGEX REPLACE "\n+$" "" err "${err}")
    string(REGEX MATCH "[^\n]*$" err "${err}")
    set(KFORGE_TORCH_FOUND FALSE PARENT_SCOPE)
    set(KFORGE_TORCH_ERROR "${Python_EXECUTABLE} cannot import torch (${err})" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  list(LENGTH lines n)
  if(NOT n EQUAL 4)
    set(KFORGE_TORCH_FOUND FALSE PARENT_SCOPE)
    set(KFORGE_TORCH_ERROR "unexpected answer from torch.utils.cpp_extension: ${out}" PARENT_SCOPE)
    return()
  endif()
  list(GET lines 0 version)
  list(GET lines 1 abi)
  list(GET lines 2 includes)
  list(GET lines 3 libdirs)
  string(REPLACE ":" ";" includes "${includes}")  # ":" kept the paths apart while ";" split the lines
  string(REPLACE ":" ";" libdirs "${libdirs}")
  set(KFORGE_TORCH_FOUND TRUE PARENT_SCOPE)
  set(KFORGE_TORCH_VERSION "${version}" PARENT_SCOPE)
  set(KFORGE_TORCH_CXX11_ABI "${abi}" PARENT_SCOPE)
  set(KFORGE_TORCH_INCLUDE_DIRS "${includes}" PARENT_SCOPE)
  set(KFORGE_TORCH_LIBRARY_DIRS "${libdirs}" PARENT_SCOPE)
endfunction()
